"""TorchServe test handler whose ``initialize`` holds until the test lets it go: it writes the file
``gate.json`` names with ``.started`` appended, then waits (60 s at most) for that file itself, as
recserve's handler holds its worker while it maps a version."""

import json
import time
from pathlib import Path

_initialized = False


def handle(data, context):
    global _initialized
    if not _initialized:
        gate = Path(
            json.loads((Path(context.system_properties["model_dir"]) / "gate.json").read_text())["gate"]
        )
        Path(f"{gate}.started").touch()
        deadline = time.monotonic() + 60
        while not gate.exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # a test handler's stand-in for a long load, released by a file
        _initialized = True
    return None if data is None else ["ok" for _ in data]
