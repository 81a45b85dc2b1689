"""Fixtures of the stack tests: whole local stacks (`recserve up`'s LocalStack) on loopback."""

from __future__ import annotations

import pytest

from serving.stack.local import LocalStack, StackConfig


@pytest.fixture(scope="module")
def start_stack():
    """``start_stack(root, model, **config)``: a LocalStack over the store at ``root``, every port
    picked free on loopback (``config``: more StackConfig fields; lookups remote unless it says
    otherwise: these tests are about the PS shards and the worker the handler calls), started;
    every stack started so is stopped when the module is done."""
    started: list[LocalStack] = []

    def start(root, model: str, **config) -> LocalStack:
        cfg = StackConfig(
            store=str(root),
            model=model,
            http_port=0,
            management_port=0,
            metrics_port=0,
            **{"lookups": "remote", **config},
        )
        started.append(LocalStack(cfg).start())
        return started[-1]

    yield start
    for stack in reversed(started):
        stack.stop()


class Prometheus:
    """A real Prometheus (Debian's package) on a free loopback port, with ``config`` (a dict of
    prometheus.yml) written into ``workdir``; ``query(expr)`` evaluates through its HTTP API."""

    def __init__(self, workdir, config: dict):
        import shutil
        import subprocess

        import yaml

        from tests.helpers import free_port, wait_until

        binary = shutil.which("prometheus")
        if binary is None:  # `make test` installs it; a run without it must not pass quietly
            pytest.fail("no prometheus binary: `apt-get install prometheus` (make test does)")
        self.url = f"http://127.0.0.1:{free_port()}"
        path = workdir / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        self.log = workdir / "prometheus.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [binary, f"--config.file={path}", f"--storage.tsdb.path={workdir / 'tsdb'}",
                 f"--web.listen-address={self.url.removeprefix('http://')}", "--log.level=warn"],
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        wait_until(self._ready, 60, f"prometheus ready (log: {self.log})")

    def _ready(self) -> bool:
        import urllib.request

        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited: {self.log.read_text()[-2000:]}")
        try:
            return urllib.request.urlopen(f"{self.url}/-/ready", timeout=2).status == 200
        except OSError:
            return False

    def query(self, expr: str) -> list:
        """The result vector of ``expr`` now; an AssertionError naming the expression and
        Prometheus's error when it does not evaluate."""
        import json
        import urllib.error
        import urllib.parse
        import urllib.request

        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            body = json.loads(urllib.request.urlopen(url, timeout=10).read())
        except urllib.error.HTTPError as e:
            body = json.loads(e.read())
        assert body["status"] == "success", f"{expr}: {body.get('errorType')}: {body.get('error')}"
        return body["data"]["result"]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture
def prometheus(tmp_path):
    """``prometheus(config)`` -> a started ``Prometheus``, stopped after the test."""
    started: list[Prometheus] = []

    def start(config: dict) -> Prometheus:
        started.append(Prometheus(tmp_path, config))
        return started[-1]

    yield start
    for p in started:
        p.stop()
