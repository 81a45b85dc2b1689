"""``none``: a transport that listens to nothing (the poll alone)."""

from __future__ import annotations

from serving.notices.registry import Transport, register


class _Nothing:
    listening = False

    def close(self) -> None:
        pass


TRANSPORT = register(Transport("none", lambda where, model_dir, notices: _Nothing()))
