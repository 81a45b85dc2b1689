"""docs/cli.md's lines for TLS, replicas and releases, run as a user types them: each line a
subprocess, exactly as printed, with the store in a temp dir via ``$RECSERVE_STORE`` (the quick tour
does the same for its lines)."""

import os
import re
import shlex
import subprocess

import pytest

from tests.helpers import ROOT, doc_blocks, port_free, recserve_argv, split_comment


def cli_lines() -> dict[str, str]:
    """docs/cli.md's block: each line (comment cut) keyed by the line itself."""
    (block,) = doc_blocks("docs/cli.md")
    return {x: x for x in (split_comment(line)[0] for line in block)}


def line(prefix: str) -> str:
    found = [x for x in cli_lines() if x.startswith(prefix)]
    assert len(found) == 1, (prefix, found)
    return found[0]


@pytest.mark.slow
def test_tls_replicas_worker_and_publish_lines_run_as_printed(tmp_path, readme_ports):
    ports = (8080, 8081, 8082, 50061, 50062, 50063, 50064, 50071)
    if not all(port_free(p) for p in ports):
        pytest.skip("the documented default ports are taken on this machine")
    store = tmp_path / "store"
    env = {**os.environ, "RECSERVE_STORE": str(store)}

    def run(text: str, timeout: int = 600) -> str:
        done = subprocess.run(recserve_argv(text), cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
        assert done.returncode == 0, f"{text}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done.stdout + done.stderr

    down = line("recserve down --model criteo")
    try:
        run(line("recserve train --arch deepfm --model criteo"))  # version 1, published
        out = run(line("recserve up --model criteo --tls"))
        assert "serving criteo version 1" in out and "TLS is ON" in out, out
        assert "stopped" in run(down)
        out = run(line("recserve up --model criteo --replicas 2"))
        assert "serving criteo version 1" in out and out.count("ps shard") >= 4, out
        assert "stopped" in run(down)
        _worker_over_replicas(store, env)
        run("recserve train --model criteo --epochs 1")  # version 2: publishable
        run("recserve train --model criteo --epochs 1 --dim 8")  # version 3: another shape
        assert "CURRENT -> 2" in run(line("recserve publish --model criteo 2"))
        refused = subprocess.run(recserve_argv("recserve publish --model criteo 3"), cwd=ROOT, env=env,
                                 capture_output=True, text=True, timeout=120)  # fmt: skip
        assert refused.returncode == 1 and "dim" in refused.stderr, refused.stderr
        out = run(line("recserve publish --model criteo 3 --allow-schema-change"))
        assert "CURRENT -> 3" in out and "restart" in out, out
        assert (store / "criteo" / "CURRENT").read_text().strip() == "3"
    finally:
        subprocess.run(recserve_argv(down), cwd=ROOT, env=env, capture_output=True, timeout=120)


def _worker_over_replicas(store, env) -> None:
    """The replicas worker line, over four PS processes on the ports it names (2 shards x 2)."""
    from serving.rpc.health import wait_serving
    from serving.rpc.procs import stop_children

    text = line("recserve worker --ps '127.0.0.1:50061|")
    spec = shlex.split(text)[shlex.split(text).index("--ps") + 1]
    procs = []
    try:
        for shard, replicas in enumerate(spec.split(",")):
            for address in replicas.split("|"):
                argv = f"recserve ps-serve {store}/criteo --shard {shard} --num-shards 2 --port {address.split(':')[1]}"
                procs.append(subprocess.Popen(recserve_argv(argv), cwd=ROOT, env=env,
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))  # fmt: skip
        procs.append(subprocess.Popen(recserve_argv(text), cwd=ROOT, env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))  # fmt: skip
        import grpc

        with grpc.insecure_channel("127.0.0.1:50071") as channel:
            wait_serving(channel, timeout_s=120)  # every shard has a SERVING replica
    finally:
        stop_children(procs)


@pytest.mark.slow
def test_serve_and_colocated_up_lines_run_as_printed(tmp_path, readme_ports):
    """`recserve serve --model criteo` and `recserve up ... --lookups colocated` as printed: each
    scores the requests of the documented score line like the trainer's offline scores."""
    import json
    import signal

    import numpy as np

    from tests.helpers import wait_until

    if not all(port_free(p) for p in (8080, 8081, 8082)):
        pytest.skip("the documented default ports 8080-8082 are taken on this machine")
    store = tmp_path / "store"
    env = {**os.environ, "RECSERVE_STORE": str(store)}
    run = lambda argv: subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)  # noqa: E731
    done = run(recserve_argv(line("recserve train --arch deepfm --model criteo")))
    assert done.returncode == 0, done.stderr[-3000:]
    offline = np.load(store / "criteo" / "1" / "eval" / "scores.npy")
    expected = np.round(np.concatenate([offline[:5], offline[200:205]]), 4)  # what `score` prints of each
    score = "recserve score data/criteo/wide_resdnn_criteo_test.tsv --url http://127.0.0.1:8080/predictions/criteo --limit 400"

    def scored(key_file: str) -> np.ndarray:
        done = run(recserve_argv(f"{score} --key-file {key_file}"))
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        heads = re.findall(r"request \d+: 200 scores \[([0-9., ]+), \.\.\.\] versions (.*)", done.stdout)
        assert len(heads) == 2 and all('"embedding": "1"' in v for _, v in heads), done.stdout
        return np.array([float(x) for head, _ in heads for x in head.split(", ")])

    proc = subprocess.Popen(recserve_argv(line("recserve serve --model criteo")), cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        key_file = store / ".run" / "criteo" / "serve-key_file.json"
        wait_until(lambda: key_file.exists() and json.loads(_ping(8080) or "{}").get("status") == "Healthy", 120,
                   "recserve serve healthy")  # fmt: skip
        assert np.abs(scored(str(key_file)) - expected).max() <= 1e-4
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.stdout.read()[-3000:]
    down = line("recserve down --model criteo")
    try:
        out = run(recserve_argv(line("recserve up --model criteo --lookups colocated")))
        assert out.returncode == 0 and "serving criteo version 1" in out.stdout, (
            out.stdout[-3000:] + out.stderr[-3000:]
        )
        key = re.search(r"from (\S+key_file\S*\.json)", out.stdout).group(1)
        assert np.abs(scored(key) - expected).max() <= 1e-4
    finally:
        run(recserve_argv(down))


def _ping(port: int) -> str:
    import http.client

    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/ping")
        return conn.getresponse().read().decode()
    except OSError:
        return ""
