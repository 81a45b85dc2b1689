"""TorchServe test handler whose ``initialize`` holds until the test lets it go, as recserve's
handler holds its worker while it maps a version: it opens the FIFO ``gate.json`` names, writes
that path with ``.started`` appended, then blocks until the test writes into the FIFO (60 s at
most: ``select``, which on Linux waits for a FIFO's first writer)."""

import json
import os
import select
from pathlib import Path

_initialized = False


def handle(data, context):
    global _initialized
    if not _initialized:
        gate = json.loads((Path(context.system_properties["model_dir"]) / "gate.json").read_text())["gate"]
        fd = os.open(gate, os.O_RDONLY | os.O_NONBLOCK)  # open first: the test writes once it sees .started
        try:
            Path(f"{gate}.started").touch()
            select.select([fd], [], [], 60)
        finally:
            os.close(fd)
        _initialized = True
    return None if data is None else ["ok" for _ in data]
