"""The learning loop's contract, on the floor under serving and training (of this project it
imports only ``features`` and ``model_store``): what flows through Kafka from the frontends to the streaming trainer,
and the role that joins it.

- ``records``: the impression, event and sample records, one layout each, one reader and writer;
- ``rows``: a scored batch's rows as samples carry them;
- ``sample_batch``: samples read together (``read_samples``, as the streaming trainer reads a
  consumed batch) and the batch's operations (``take``, ``concat``, ``misfits``, ``to_batch``);
- ``join``: one partition's join of impressions and events into labelled samples;
- ``joiner`` and ``config``: the ``recserve join`` process and its configuration;
- ``dead_letter``: the one dead-letter convention of every consumer (topic name rule, headers);
- ``guard`` and ``quarantine``: the joiner's input guard and the replay of what it quarantined;
- ``arms``, ``sequential`` and ``aa``: experiments' per-arm online metrics from joined samples,
  the anytime-valid rule that promotes or aborts a candidate, and its A/A replays;
  ``watch``: the ``recserve experiment watch`` role (per-arm metrics from the samples topic, the
  rule, ``--auto``).

The frontends write impressions (``serving``), the streaming trainer reads samples
(``training.follow`` through ``training.sources.kafka``); the test broker is
``loadtest.mockbroker``."""
