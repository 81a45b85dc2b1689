"""training/ranks.py: the dense network's device, and the refusals where the device asked for is
not there (on this CPU host for real; a GPU host's counts only through torch.cuda's two answers)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from training.config import TrainConfig
from training.ranks import DeviceError, choose_device

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_is_the_cpu_and_auto_is_a_gpu_only_where_torch_sees_one():
    assert choose_device("cpu") == torch.device("cpu")
    assert choose_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_an_unknown_device_is_a_configuration_error():
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda, got 'gpu'"):
        TrainConfig(device="gpu")


def test_train_on_cuda_where_torch_sees_none_exits_2_naming_why():
    """`recserve train --device cuda` with the GPUs hidden: refused before anything starts."""
    cmd = [sys.executable, "-m", "recserve", "train", "--device", "cuda", "--no-progress"]
    env = os.environ | {"CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert "cannot train here: --device cuda: torch sees no CUDA device" in last, last
    assert "Traceback" not in run.stderr and run.stdout == ""


@pytest.fixture
def one_gpu(monkeypatch):
    """torch.cuda as a one-GPU host answers it (this unit test only asks the two questions)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    return monkeypatch


@pytest.mark.parametrize("choice", ["auto", "cuda"])
def test_local_rank_r_takes_gpu_r(one_gpu, choice):
    one_gpu.setenv("LOCAL_RANK", "0")
    one_gpu.setenv("LOCAL_WORLD_SIZE", "1")
    assert choose_device(choice) == torch.device("cuda", 0)


@pytest.mark.parametrize(("local_rank", "local_world"), [("0", "2"), ("1", "2"), ("1", None)])
def test_more_ranks_than_gpus_on_a_host_are_refused_with_the_ways_out(one_gpu, local_rank, local_world):
    one_gpu.setenv("LOCAL_RANK", local_rank)
    if local_world is None:  # a launcher that sets no LOCAL_WORLD_SIZE: the rank alone tells
        one_gpu.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        one_gpu.setenv("LOCAL_WORLD_SIZE", local_world)
    with pytest.raises(DeviceError) as e:
        choose_device("auto")
    assert str(e.value) == (
        "2 ranks on this host and 1 GPU: NCCL needs a GPU of its own for each rank. Start torchrun "
        "with --nproc-per-node 1, or train on the CPU with --device cpu"
    )
    assert choose_device("cpu") == torch.device("cpu")  # the second way out
