"""`make test-image`, inside the image (``buildah run``): recserve --help, a Parquet file written
by ``recserve synth`` read back, then train a version on the bundled Criteo split, serve it with
the lean frontend (token auth on, its default workers) and score 400 rows through it. The frontend
must serve within ``READY_S`` of its start, loading every kernel from the numba cache the image
carries (it writes nothing to it: a kernel it compiled would be a new file). ``smoke.py torchserve`` (in
recserve-torchserve) trains the same way, then starts TorchServe's Java frontend with the
handler's archive of that version (co-located lookups: the handler maps the version's shards) and
scores 400 rows through it, token auth on. Exits non-zero, with the failing step's output, when
any step fails."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

TEST = "data/criteo/wide_resdnn_criteo_test.tsv"
READY_S = 5.0
"""How soon after its start the frontend must serve (issue 57: 25 s with a cold numba cache)."""
HANDLER = "/app/handlers/recserve_handler.py"  # where Containerfile.torchserve puts it


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cache_files() -> set[tuple[str, int]]:
    """(path, mtime) of every file in the image's numba cache ($NUMBA_CACHE_DIR)."""
    root = Path(os.environ["NUMBA_CACHE_DIR"])
    return {(str(p), p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def scored(out: str) -> None:
    if out.count(": 200 scores") != 2:
        sys.exit(f"recserve score did not get two replies of 200 scores:\n{out[-3000:]}")


def torchserve(store: Path) -> None:
    """TorchServe (Java 17, the handler in an archive, as components/torchserve runs it) scores."""
    import model_store as ms
    from serving.torchserve import TorchServe, TorchServeConfig, archive

    vdir = ms.version_dir(store, "criteo", ms.current(store, "criteo") or "")
    (store / "scoring.json").write_text(json.dumps({"version_dir": str(vdir), "lookups": "colocated"}))
    mar = archive(HANDLER, [store / "scoring.json"], "criteo", "1", store / "mars")
    p = [free_port() for _ in range(5)]
    cfg = TorchServeConfig(model_store=store / "mars", run_dir=store / "ts", inference_port=p[0],
                           management_port=p[1], metrics_port=p[2], grpc_inference_port=p[3],
                           grpc_management_port=p[4])  # fmt: skip
    try:
        with TorchServe(cfg) as ts:
            ts.management().register(mar.name, "criteo")  # synchronous: returns once its worker is up
            scored(run("recserve", "score", TEST, "--url", f"{cfg.url(p[0])}/predictions/criteo",
                       "--key-file", str(ts.key_file), "--limit", "400"))  # fmt: skip
            print(f"image smoke test: TorchServe ({java()}) scored 400 rows through the handler", flush=True)
    except (RuntimeError, TimeoutError) as e:  # TorchServeError is a RuntimeError
        model_log = store / "ts" / "logs" / "model_log.log"  # the handler's workers' output
        tail = model_log.read_text(errors="replace")[-3000:] if model_log.exists() else ""
        sys.exit(f"TorchServe: {e}\n{tail}")


def java() -> str:
    done = subprocess.run(["java", "-version"], capture_output=True, text=True)
    return done.stderr.splitlines()[0] if done.returncode == 0 else "no java"


def main() -> None:
    run("recserve", "--help")
    store = Path(tempfile.mkdtemp(prefix="recserve-smoke-"))
    if sys.argv[1:] != ["torchserve"]:
        parquet_roundtrip(store / "synth.parquet")
    run("recserve", "train", "--store", str(store), "--epochs", "1", "--publish", "--no-progress")
    if sys.argv[1:] == ["torchserve"]:
        torchserve(store)
        return
    port = free_port()
    log = open(store / "serve.log", "wb")
    cache = cache_files()
    started = time.monotonic()
    serve = subprocess.Popen(["recserve", "serve", "--store", str(store), "--port", str(port)],
                             stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = started + 120
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
            time.sleep(0.05)
        ready_s = time.monotonic() - started
        compiled = sorted(cache_files() - cache)
        if compiled:
            sys.exit(f"recserve serve compiled kernels the image's numba cache lacks: {compiled}")
        if ready_s > READY_S:
            sys.exit(f"recserve serve served {ready_s:.1f} s after its start, over {READY_S:g} s: "
                     f"{(store / 'serve.log').read_text()[-3000:]}")  # fmt: skip
        out = run("recserve", "score", TEST, "--url", f"http://127.0.0.1:{port}/predictions/criteo",
                  "--key-file", str(store / ".run" / "criteo" / "serve-key_file.json"), "--limit", "400")  # fmt: skip
        scored(out)
        print(f"image smoke test: trained, served {ready_s:.1f} s after the start (the numba cache warm) and "
              "scored 400 rows", flush=True)  # fmt: skip
    finally:
        serve.terminate()
        serve.wait(30)


if __name__ == "__main__":
    main()
