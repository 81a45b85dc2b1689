"""`make test-image`, inside the image (``buildah run``): recserve --help, a Parquet file written
by ``recserve synth`` read back, then train a version on the bundled Criteo split, serve it with
the lean frontend (token auth on) and score 400 rows through it. Exits non-zero, with the failing step's output, when any step fails."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

TEST = "data/criteo/wide_resdnn_criteo_test.tsv"


def run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done.stdout


def parquet_roundtrip(path: Path) -> None:
    """The image's pyarrow (Flight and S3 removed) still writes and reads Parquet."""
    from features import stream
    from features.schema import load_schema

    run("recserve", "synth", "--rows", "1000", "--out", str(path))
    rows = len(stream.read(path, load_schema("data/schemas/criteo.yaml")).columns["label"])
    if rows != 1000:
        sys.exit(f"{path}: read {rows} rows back, wrote 1000")


def main() -> None:
    run("recserve", "--help")
    store = Path(tempfile.mkdtemp(prefix="recserve-smoke-"))
    parquet_roundtrip(store / "synth.parquet")
    run("recserve", "train", "--store", str(store), "--epochs", "1", "--publish", "--no-progress")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(store / "serve.log", "wb")
    serve = subprocess.Popen(["recserve", "serve", "--store", str(store), "--port", str(port)],
                             stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            if serve.poll() is not None:
                sys.exit(
                    f"recserve serve exited {serve.returncode}: {(store / 'serve.log').read_text()[-3000:]}"
                )
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2).status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                sys.exit(f"recserve serve not answering /ping: {(store / 'serve.log').read_text()[-3000:]}")
            time.sleep(0.5)
        out = run("recserve", "score", TEST, "--url", f"http://127.0.0.1:{port}/predictions/criteo",
                  "--key-file", str(store / ".run" / "criteo" / "serve-key_file.json"), "--limit", "400")  # fmt: skip
        if out.count(": 200 scores") != 2:
            sys.exit(f"recserve score did not get two replies of 200 scores:\n{out[-3000:]}")
        print("image smoke test: trained, served and scored 400 rows", flush=True)
    finally:
        serve.terminate()
        serve.wait(30)


if __name__ == "__main__":
    main()
