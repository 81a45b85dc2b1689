"""Small helpers shared by tests."""

import asyncio
import contextlib
import fcntl
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from loadtest.common import train_version  # noqa: F401  (the benches' own; tests share it)
from serving.rpc.procs import free_ports

ROOT = Path(__file__).resolve().parents[1]
"""The repository's root (where the README, the Makefile and data/ are)."""


@contextlib.contextmanager
def exclusive(name: str):
    """Held by one test at a time across every pytest process on this machine (the pytest-xdist
    workers of ``make test`` among them): an flock on a file in the temp directory; the others
    block until it is released."""
    with open(Path(tempfile.gettempdir()) / f"recserve-tests-{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


SHELL_FENCES = ("bash", "sh", "shell")
"""The languages of a fenced block whose lines are commands (tests/test_docs.py: each one runs)."""


@contextlib.contextmanager
def bash_block(block: list[str], cwd: Path, out: str = "out.txt"):
    """Run a docs block as printed, one ``bash -c`` script in ``cwd`` with the venv first on PATH
    and the repo importable, in its own session, its output to ``cwd/out`` (a file: the block's
    background jobs keep it open); yields the process. On the way out the session is killed (the
    broker and whatever the block started in the background)."""
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT)}  # fmt: skip
    with open(cwd / out, "w") as log:
        proc = subprocess.Popen(["bash", "-c", "\n".join(block)], cwd=cwd, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def doc_files() -> list[str]:
    """The documents whose command lines run in tests: README.md and docs/*.md, as paths under ROOT."""
    return ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


def doc_blocks(doc: str, heading: str = "", lang: str = "bash") -> list[list[str]]:
    """The fenced ``lang`` blocks of ``doc`` (a path under ROOT: "README.md", "docs/serving.md") in
    the section titled ``heading`` (up to the next heading of its level or above; "": the whole
    document), in order, each as its lines: backslash continuations joined, the fence's indent and
    blank lines dropped. No such block is an error naming the document and the heading."""
    blocks = [
        list(b)
        for titles, fence, b in doc_sections(doc)
        if fence == lang and (not heading or heading in titles)
    ]
    assert blocks, f"{doc}: no {lang} block under a heading {heading!r}"
    return blocks


def doc_sections(doc: str) -> list[tuple[tuple[str, ...], str, tuple[str, ...]]]:
    """Every fenced block of ``doc`` as (the titles of the headings it lies under, outermost first;
    its fence's language; its lines as ``doc_blocks`` gives them)."""
    import re

    out: list[tuple[tuple[str, ...], str, tuple[str, ...]]] = []
    path: list[tuple[int, str]] = []
    fence: tuple[str, str] | None = None  # (indent, language) of the block being read
    lines: list[str] = []
    for raw in (ROOT / doc).read_text().replace("\\\n", " ").splitlines():
        opening = re.match(r"^(\s*)```(\S*)\s*$", raw)
        if fence is None and opening:
            fence, lines = (opening.group(1), opening.group(2)), []
        elif fence is not None and raw.strip() == "```":
            out.append((tuple(title for _, title in path), fence[1], tuple(lines)))
            fence = None
        elif fence is not None:
            if raw.strip():
                lines.append(raw.removeprefix(fence[0]).rstrip())
        elif heading := re.match(r"^(#+) (.*)$", raw):
            level = len(heading.group(1))
            path = [(n, title) for n, title in path if n < level] + [(level, heading.group(2).strip())]
    assert fence is None, f"{doc}: a fenced block is not closed"
    return out


def split_comment(line: str) -> tuple[str, str]:
    """(command, comment) of a documented line: the comment starts at a ``#`` after two spaces."""
    import re

    command, *comment = re.split(r"\s{2,}#\s*", line, maxsplit=1)
    return command.strip(), "".join(comment).strip()


def recserve_argv(line: str) -> list[str]:
    """A README line ``recserve ...`` as the argv that runs it: the console script pip installed
    (or ``python -m recserve`` where there is none)."""
    argv = shlex.split(line)
    assert argv[0] == "recserve", line
    script = Path(sys.executable).parent / "recserve"
    return [str(script), *argv[1:]] if script.exists() else [sys.executable, "-m", "recserve", *argv[1:]]


def port_free(port: int) -> bool:
    """Nothing listens on loopback ``port`` now (the README's fixed ports)."""
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free right now (the OS picks it)."""
    return free_ports(1, host)[0]


@contextlib.contextmanager
def ps_in_thread(cfg):
    """A PS shard (``serving.ps.server.serve(cfg)``, ``cfg.server.port`` 0) on a thread of this process,
    on a free loopback port; yields its address and stops it after."""
    from serving.ps.server import serve

    loop = asyncio.new_event_loop()
    started = loop.create_future()
    task = loop.create_task(serve(cfg, started))

    def run() -> None:
        with contextlib.suppress(asyncio.CancelledError):  # the stop below
            loop.run_until_complete(task)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    async def port() -> int:
        await asyncio.wait({started, task}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
        if not started.done():
            task.result()  # serve's own error
        return started.result()

    try:
        yield f"127.0.0.1:{asyncio.run_coroutine_threadsafe(port(), loop).result(90)}"
    finally:
        loop.call_soon_threadsafe(task.cancel)
        thread.join(10)
        loop.close()


def gone(pid: int) -> bool:
    """Process ``pid`` has exited: there is no such process, or it is a zombie whose parent (maybe
    this process) has not reaped it yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] == "Z"


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.05):
    """Poll ``predicate`` until it returns something truthy (returned), or fail after ``timeout_s``
    saying ``what`` was waited for and the last value seen."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {timeout_s}s (last: {value!r})")
        time.sleep(poll_s)  # the poll interval of this deadline-bound wait on a fact (no assert follows it)


def exit_ok(procs, timeout_s: float = 600) -> None:
    """Wait for every ``(name, Popen, log path)`` to exit; one that fails or outlives ``timeout_s``
    is an AssertionError with its log's tail."""
    import subprocess

    for name, proc, log in procs:
        try:
            rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{name} still running after {timeout_s:.0f} s: {log.read_text()[-3000:]}"
            ) from None
        assert rc == 0, f"{name} exited {rc}: {log.read_text()[-3000:]}"


def second_half(directory) -> str:
    """The second half of the Criteo training rows, written into ``directory``: a retrain on other
    data (other fitted statistics, the same schema)."""
    from pathlib import Path

    lines = open("data/criteo/wide_resdnn_criteo_train.tsv", "rb").read().splitlines(keepends=True)
    path = Path(directory) / "train-second-half.tsv"
    path.write_bytes(b"".join(lines[len(lines) // 2 :]))
    return str(path)


def fuzz_payloads(valid: bytes, n: int, seed: int = 0):
    """``n`` request payloads: half random byte strings (0-256 bytes), half ``valid`` mutated
    (bytes flipped, inserted, deleted, or cut off), reproducible from ``seed``."""
    rnd = random.Random(seed)
    for i in range(n):
        if i % 2 == 0 or not valid:
            yield rnd.randbytes(rnd.randint(0, 256))
            continue
        data = bytearray(valid)
        for _ in range(rnd.randint(1, 4)):
            at = rnd.randrange(len(data) + 1)
            kind = rnd.randrange(4)
            if kind == 0 and at < len(data):
                data[at] ^= 1 << rnd.randrange(8)
            elif kind == 1:
                data[at:at] = rnd.randbytes(rnd.randint(1, 8))
            elif kind == 2:
                del data[at : at + rnd.randint(1, 8)]
            else:
                del data[at:]
        yield bytes(data)


def raw_call(channel, method: str):
    """A unary call of ``method`` ("/package.Service/Method") that sends and returns bytes as they
    are: what a client that does not use our stubs (or a fuzzer) sends."""
    return channel.unary_unary(method, request_serializer=None, response_deserializer=None)


__all__ = [
    "ROOT",
    "free_port",
    "free_ports",
    "fuzz_payloads",
    "gone",
    "port_free",
    "ps_in_thread",
    "raw_call",
    "recserve_argv",
    "second_half",
    "train_version",
    "wait_until",
]
