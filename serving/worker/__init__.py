"""The embedding worker: the library (``core``: route, pool, update), its gRPC service
(``server``, ``recserve worker``) and client (``client``)."""
