"""Learning from the stream, the serving side: the records that flow through Kafka (impressions,
events, samples), the joiner that turns impressions and events into labelled samples
(``recserve join``), and a Kafka broker for tests, the demo and benches (``mockbroker``).

Nothing here imports ``training``: the joiner is a serving-side role; the streaming trainer reads
the samples topic through ``records.decode_sample``."""
