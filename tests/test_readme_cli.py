"""The README's CLI lines for TLS, replicas and releases, run as a user types them: each line a
subprocess, exactly as printed, with the store in a temp dir via ``$RECSERVE_STORE`` (the quick tour
does the same for its lines)."""

import os
import re
import shlex
import subprocess

import pytest

from tests.test_quick_tour import ROOT, port_free, recserve_argv


def cli_lines() -> dict[str, str]:
    """The README's CLI block: each line (comment cut) keyed by the line itself."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## CLI\n.*?```bash\n(.*?)```", text, re.S).group(1)
    return {x: x for x in (line.split("  #")[0].strip() for line in block.splitlines()) if x}


def line(prefix: str) -> str:
    found = [x for x in cli_lines() if x.startswith(prefix)]
    assert len(found) == 1, (prefix, found)
    return found[0]


@pytest.mark.slow
def test_tls_replicas_worker_and_publish_lines_run_as_printed(tmp_path):
    ports = (8080, 8081, 8082, 50061, 50062, 50063, 50064, 50071)
    if not all(port_free(p) for p in ports):
        pytest.skip("the README's default ports are taken on this machine")
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
                argv = f"recserve ps --shard {shard} --num-shards 2 --port {address.split(':')[1]} --follow {store}/criteo"
                procs.append(subprocess.Popen(recserve_argv(argv), cwd=ROOT, env=env,
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))  # fmt: skip
        procs.append(subprocess.Popen(recserve_argv(text), cwd=ROOT, env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))  # fmt: skip
        import grpc

        with grpc.insecure_channel("127.0.0.1:50071") as channel:
            wait_serving(channel, timeout_s=120)  # every shard has a SERVING replica
    finally:
        stop_children(procs)
