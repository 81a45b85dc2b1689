"""recserve: the CLI (``recserve.cli``), its commands, the config mechanism and the demo; ``recserve.v1`` is the generated gRPC code."""
