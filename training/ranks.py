"""This process's place in a training job: its device, its rank, and the two collectives the
trainer needs beside DDP's.

One process, or one per rank under torchrun (``WORLD_SIZE`` > 1). The dense network trains on the
device ``--device`` names: ``auto`` is a GPU where torch sees one, else the CPU. On GPUs each rank
takes the GPU of its local rank and the ranks talk over NCCL, which refuses two ranks on one GPU;
so a host with more ranks than GPUs is refused before any rank joins, with the two ways out. On
the CPU the ranks talk over gloo.
"""

from __future__ import annotations

import os
import socket
from typing import TypeVar

import torch
import torch.distributed as dist

from training.attempt import attempt_rendezvous

T = TypeVar("T")


class DeviceError(RuntimeError):
    """The device asked for is not there, or not enough of it for this host's ranks."""


def choose_device(choice: str = "auto") -> torch.device:
    """The dense network's device in this process (``LOCAL_RANK`` r of ``LOCAL_WORLD_SIZE``, set
    by torchrun: GPU r). ``choice``: one of ``training.config.DEVICES`` (``TrainConfig`` checks it)."""
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError(
            "--device cuda: torch sees no CUDA device (a CPU-only torch, no driver, or "
            "CUDA_VISIBLE_DEVICES hides them)"
        )
    gpus = torch.cuda.device_count()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    ranks = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), local_rank + 1)
    if ranks > gpus:
        raise DeviceError(
            f"{ranks} ranks on this host and {gpus} GPU{'s' if gpus > 1 else ''}: NCCL needs a GPU "
            f"of its own for each rank. Start torchrun with --nproc-per-node {gpus}, or train on "
            "the CPU with --device cpu"
        )
    return torch.device("cuda", local_rank)


def join(device: torch.device) -> tuple[int, int]:
    """(rank, world size); joins the torchrun process group when WORLD_SIZE > 1, over NCCL when
    ``device`` is a GPU (made this process's current one), gloo otherwise."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    if not dist.is_initialized():
        # torchrun's restarted ranks reuse its rendezvous, where the last start's keys (every rank's
        # gloo address among them) are still set: each start's process group gets keys of its own
        rendezvous, rank, world = next(dist.rendezvous("env://"))
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, store=attempt_rendezvous(rendezvous, rank, world), rank=rank, world_size=world
        )
    return dist.get_rank(), dist.get_world_size()


def all_ranks(obj: T, world: int) -> list[T]:
    """Every rank's ``obj``, in rank order, on every rank."""
    if world == 1:
        return [obj]
    objs: list = [None] * world
    dist.all_gather_object(objs, obj)
    return objs


def agree(world: int, flag: bool) -> bool:
    """Rank 0's ``flag`` on every rank (one tiny broadcast)."""
    if world == 1:
        return flag
    t = torch.tensor([int(flag)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.broadcast(t, src=0)
    return bool(t.item())


def node_address() -> str:
    """This node's address toward the rendezvous host (torchrun's MASTER_ADDR): the interface the
    other nodes reach it on, where a node's PS shards listen when a job spans nodes. A UDP connect
    sends nothing; it only picks the route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", "29500"))))
        return s.getsockname()[0]
