"""The two roles of an embedding PS shard, one subcommand each (flags from their configs in
``serving.ps.config``, with the nested ``server`` and, for training, the ``store`` with its ``table``
spec and ``optimizer`` flattened):

- ``recserve ps``: a training shard (``TrainingShardConfig``: --load, --admin-token-file,
  --data-root, --dim, --optimizer, --lr, --l1, ...);
- ``recserve ps-serve MODEL_DIR``: a serving shard (``ServingShardConfig``: --shard, --num-shards,
  --dim, --dtype, --pin, --poll-s, --keep-previous-s), following a model's published versions.

A flag of one role given to the other is refused naming the role it belongs to (``SIBLING``,
read by ``recserve.cli``)."""

from __future__ import annotations

import types

from serving.ps.config import ServingShardConfig, TrainingShardConfig


def run(cfg: TrainingShardConfig | ServingShardConfig) -> int:
    import uvloop

    from serving.ps.server import serve

    uvloop.run(serve(cfg))
    return 0


COMMANDS = {
    "ps": types.SimpleNamespace(
        CONFIG=TrainingShardConfig, run=run, SIBLING="ps-serve", FORMERLY=(), ROLE="the training shard"
    ),
    "ps-serve": types.SimpleNamespace(
        CONFIG=ServingShardConfig,
        run=run,
        SIBLING="ps",
        FORMERLY=("--follow",),  # `recserve ps --follow DIR` before the roles were split
        ROLE="the serving shard, following MODEL_DIR",
    ),
}
