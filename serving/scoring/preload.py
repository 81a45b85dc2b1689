"""What the parent of ``recserve serve --workers N`` loads before it forks its workers, so that they
share it instead of each holding a copy.

A worker's memory is mostly what every worker holds alike: torch's libraries and the objects its
import builds (about 130 MB of heap), numba and LLVM, the scoring modules, and the kernels numba
compiled or loaded from its cache (about 35 MB). The parent imports them (``MODULES``) and decodes
one request of each form of the served version's schema (``decoding.warmup_requests``: every kernel
a decode runs), then freezes what it holds out of the garbage collector's reach (``gc.freeze``: a
collection in a worker would otherwise write to every object it inherited, copying the page). A
worker forked from it shares those pages copy-on-write with the parent and the other workers; it
copies only what it writes. The version's shard files are the page cache's, shared anyway.

Fork is safe here because the parent runs nothing that holds a lock on another thread: no Python
thread (``preload`` refuses to fork from a parent that has one), no event loop, no Kafka client,
no torch operation (torch's thread pools and OpenMP start at the first one; the workers start
their own), no CUDA. numpy's OpenBLAS pool stops itself at a fork (``pthread_atfork``) and starts
again in the child when used.
"""

from __future__ import annotations

import gc
import importlib
import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serving.scoring.lean import ServeConfig

log = logging.getLogger("recserve.serve")

MODULES = (
    "torch",  # the dense runtimes: most of a worker's heap
    "numba",  # and LLVM, scipy
    "serving.scoring.lean",
    "serving.scoring.asgi",
    "serving.scoring.decoding",
    "serving.worker.colocated",  # co-located lookups: the mapped shards
    "serving.worker.client",  # remote lookups: gRPC
    "model_store.runtimes.torchscript",
    "uvicorn.loops.uvloop",
    "uvicorn.protocols.http.httptools_impl",
    "uvicorn.lifespan.on",
)
"""Imported by the parent before the first fork."""


def preload(config: ServeConfig) -> str:
    """Import ``MODULES`` and decode the warm-up requests of the version the workers will serve
    (``--version``, else CURRENT's; none when nothing is published or its schema cannot be read:
    the workers compile what they need then), then ``gc.freeze``. Returns what it loaded, in words.
    RuntimeError when this process runs another thread: it could not fork safely."""
    started = time.monotonic()
    for name in MODULES:
        importlib.import_module(name)
    kernels = _decode_warmup(config)
    gc.collect()
    gc.freeze()
    if threading.active_count() > 1:
        names = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
        raise RuntimeError(
            f"the frontend's parent runs threads {names}: its workers cannot be forked from it"
        )
    return f"{len(MODULES)} modules and {kernels} loaded in {time.monotonic() - started:.1f} s"


def _decode_warmup(config: ServeConfig) -> str:
    import model_store as ms
    from features.schema import load_schema
    from serving.scoring.decoding import Decoder, warmup_requests

    store = Path(config.store)
    version = config.version or ms.current(store, config.model)
    if not version:
        return "no decode kernels (nothing published yet)"
    try:
        schema = load_schema(ms.version_dir(store, config.model, version) / "schema.yaml")
        decoder = Decoder(schema, config.scoring.max_items, config.scoring.max_body_bytes)
        for body, content_type in warmup_requests(decoder):
            decoder.decode(body, content_type)
    except Exception as e:  # the workers' own load names what is wrong with the version
        log.debug("no decode warm-up in the parent: %s", e)
        return f"no decode kernels ({version}: {e})"
    return f"the decode kernels of version {version}'s schema"
