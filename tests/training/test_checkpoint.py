"""Checkpoints and restart: written atomically and pruned, refused when the resumed run would read
other data, and a run continued from one (by ``--resume``, or by torchrun restarting every rank
after one is killed) ends where an uninterrupted run ends."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model_store.layout import SUCCESS
from tests.helpers import ROOT, doc_blocks, recserve_argv, wait_until
from training.checkpoint import Checkpointer, Every, latest, parse_every
from training.config import TrainConfig


def readme_lines() -> list[str]:
    """docs/training.md's "Checkpoints and restarts" block: a first run, its resume, a torchrun job."""
    (lines,) = doc_blocks("docs/training.md", "Checkpoints and restarts")
    assert len(lines) == 3 and lines[2].startswith("torchrun "), lines
    return lines


FIRST, RESUME, TORCHRUN_LINE = readme_lines()


@pytest.mark.parametrize(
    "text, every",
    [("", Every()), ("0", Every()), ("500", Every(steps=500)), ("300s", Every(seconds=300)),
     ("10m", Every(seconds=600)), ("1.5h", Every(seconds=5400))],
)  # fmt: skip
def test_every_is_steps_or_a_time(text, every):
    assert parse_every(text) == every


@pytest.mark.parametrize("text", ["ten", "5d", "-3", "1.5"])
def test_a_bad_interval_is_refused_naming_the_forms(text):
    with pytest.raises(ValueError, match="checkpoint-every"):
        parse_every(text)


def _checkpointer(directory, keep=2, clock=None, **kw) -> Checkpointer:
    return Checkpointer(directory, Every(**kw), keep, 0, 1, sync=lambda: None, agree=lambda f: f,
                        **({"clock": clock} if clock else {}))  # fmt: skip


def _save(ck: Checkpointer, step: int, config: dict | None = None):
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.Adam(model.parameters())
    return ck.save(step, 0, step, None, model, opt, extra={"rows": step}, config=config or {"seed": 0})


def test_the_newest_complete_checkpoint_is_found_and_only_keep_stay(tmp_path):
    ck = _checkpointer(tmp_path, keep=2, steps=10)
    assert latest(tmp_path) is None
    for step in (10, 20, 30):
        assert ck.due(step) and not ck.due(step + 1)
        _save(ck, step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-20", "step-30"]
    (tmp_path / ".step-40.tmp").mkdir()  # a run killed while writing step 40
    (tmp_path / "step-50").mkdir()  # no _SUCCESS: never read
    found = latest(tmp_path)
    assert found is not None and found.step == 30 and (found.path / SUCCESS).is_file()
    assert found.dense_state()["rows"] == 30 and "torch_rng" in found.rank_state(0)


def test_a_time_interval_is_due_after_that_long(tmp_path):
    now = [0.0]
    ck = _checkpointer(tmp_path, clock=lambda: now[0], seconds=60)
    assert not ck.due(1)
    now[0] = 61.0
    assert ck.due(2)
    _save(ck, 2)
    assert not ck.due(3)


def test_resuming_with_other_ranks_or_other_data_is_refused(tmp_path):
    _save(_checkpointer(tmp_path, steps=1), 1, {"seed": 0, "batch_size": 128})
    found = latest(tmp_path)
    found.check(1, {"seed": 0, "batch_size": 128})
    with pytest.raises(ValueError, match="written by 1 ranks, resumed with 2"):
        found.check(2, {"seed": 0, "batch_size": 128})
    with pytest.raises(ValueError, match="batch_size: 128 -> 256"):
        found.check(1, {"seed": 0, "batch_size": 256})
    _save(_checkpointer(tmp_path / "t", steps=1), 1, {"table": {"dim": 16, "optimizer": {"lr": 0.1}}})
    found = latest(tmp_path / "t")
    found.check(1, {"table": {"dim": 16, "optimizer": {"lr": 0.2}}})  # the table's dim must match, not its lr
    with pytest.raises(ValueError, match="table.dim: 16 -> 8"):
        found.check(1, {"table": {"dim": 8, "optimizer": {"lr": 0.1}}})


def test_the_in_process_baseline_has_no_checkpoints():
    with pytest.raises(ValueError, match="checkpoints need --embeddings ps"):
        TrainConfig(embeddings="inprocess", checkpoint_every="10")


# ---- real runs ----------------------------------------------------------------------------------
def _result(out: str) -> dict:
    return json.loads([line for line in out.splitlines() if line.startswith('{"auc"')][-1])


def _env(store: Path, tmp: Path) -> dict:
    """The documented conditions: $RECSERVE_STORE is the store, torchrun and recserve on PATH; the
    runs' temporary files (a rank's PS logs and admin token) in ``tmp``, a directory of the test's
    own, whose cleanup takes them even from a rank that was SIGKILLed. A CPU host: a GPU host with
    fewer GPUs than the line's two ranks refuses it (tests/training/test_cuda.py)."""
    tmp.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "RECSERVE_STORE": str(store), "TMPDIR": str(tmp), "CUDA_VISIBLE_DEVICES": "",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # fmt: skip


def _argv(line: str) -> list[str]:
    return recserve_argv(line) if line.startswith("recserve ") else shlex.split(line)


def _train(line: str, where: Path, timeout_s: float = 300) -> dict:
    """Run ``line`` with the store ``where/store`` and temporary files in ``where/tmp``."""
    env = _env(where / "store", where / "tmp")
    done = subprocess.run(_argv(line), cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout_s)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return _result(done.stdout) | {"log": done.stderr}


@pytest.mark.slow
def test_resume_continues_exactly_where_the_checkpoint_left_off(tmp_path):
    whole = _train(FIRST, tmp_path)
    ckpts = tmp_path / "store" / "criteo" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-100", "step-120"]  # 126 steps, keep 2
    resumed = _train(RESUME, tmp_path)
    assert "resumes at step 120 (epoch 2, batch 57)" in resumed["log"]
    assert resumed["steps"] == whole["steps"] == 126
    assert abs(resumed["auc"] - whole["auc"]) <= 1e-3, (resumed["auc"], whole["auc"])


def _pids() -> dict[int, tuple[int, list[bytes], list[bytes]]]:
    """{pid: (ppid, argv, environ)} of every process."""
    out = {}
    for proc in Path("/proc").iterdir():
        try:
            out[int(proc.name)] = (
                int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]),
                (proc / "cmdline").read_bytes().split(b"\0"),
                (proc / "environ").read_bytes().split(b"\0"),
            )
        except (OSError, ValueError, IndexError):
            continue
    return out


def _rank_process(store: Path, rank: int) -> tuple[int, list[int]] | None:
    """(pid, its PS shard children) of the training process of ``rank`` whose store is ``store``."""
    procs = _pids()
    for pid, (_, argv, env) in procs.items():
        if b"train" in argv and f"RECSERVE_STORE={store}".encode() in env and f"RANK={rank}".encode() in env:
            return pid, [c for c, (ppid, a, _) in procs.items() if ppid == pid and b"ps" in a]
    return None


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    return _train(TORCHRUN_LINE, tmp_path_factory.mktemp("whole"))


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_torchrun_restarts_every_rank_from_the_checkpoint_after_one_is_killed(rank, uninterrupted, tmp_path):
    """The documented torchrun line; a rank is SIGKILLed mid-epoch (rank 0 with the PS shards the job
    started: they die with it, by the kernel's parent-death signal); torchrun restarts both ranks, which
    resume from the newest checkpoint (new shards loaded with its rows) and end within 0.005 AUC
    of an uninterrupted run."""
    store = tmp_path / "store"
    log = tmp_path / "job.log"
    with open(log, "w") as out:
        job = subprocess.Popen(_argv(TORCHRUN_LINE), cwd=ROOT, env=_env(store, tmp_path / "tmp"), stdout=out,
                               stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        wait_until(lambda: (store / "criteo" / "checkpoints" / "step-20").is_dir() or job.poll() is not None,
                   120, "checkpoint step-20 written")  # fmt: skip
        found = _rank_process(store, rank)
        assert found is not None, log.read_text()[-3000:]
        victim, shards = found
        assert len(shards) == (2 if rank == 0 else 0), shards
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: not any(Path(f"/proc/{p}").exists() for p in shards), 30,
                   "the killed rank's PS shards gone")  # fmt: skip
        assert job.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        if job.poll() is None:
            job.kill()
    text = log.read_text()
    assert "resumes at step" in text and "resumed the PS shards from" in text, text[-3000:]
    resumed = _result(text)
    assert resumed["steps"] == uninterrupted["steps"] == 62
    assert abs(resumed["auc"] - uninterrupted["auc"]) <= 0.005, (resumed["auc"], uninterrupted["auc"])
