"""``recserve versions`` / ``publish`` / ``rollback``: release management of the model store
(``model_store.releases``: the one gate, the one publish with HISTORY), and what a running stack
actually serves (``serving.stack.view.serving_view``)."""

from __future__ import annotations

import sys
import time
import types
from dataclasses import dataclass, field

from recserve.config import store_field


@dataclass
class VersionsConfig:
    """``recserve versions``."""

    store: str = store_field()
    """Model-store root."""
    model: str = "criteo"
    """Model name in the store."""
    keep: int = 0
    """Delete all but the newest KEEP versions (never CURRENT, the rollback target or a pinned
    version; 0: keep all)."""
    pin: str = field(default="", metadata={"metavar": "VERSION"})
    """Pin VERSION: retention (--keep, a streaming trainer's --keep-versions) never deletes it."""
    unpin: str = field(default="", metadata={"metavar": "VERSION"})
    """Remove the pin of VERSION."""
    run_dir: str = ""
    """Run dir of the stack `recserve up` started, to show what it serves ('': <store>/.run/<model>)."""


@dataclass
class PublishConfig:
    """``recserve publish``."""

    version: str = field(default="", metadata={"positional": True, "help": "version to make CURRENT"})
    """Version to make CURRENT."""
    store: str = store_field()
    """Model-store root."""
    model: str = "criteo"
    """Model name in the store."""
    allow_schema_change: bool = False
    """Publish a version of another feature schema or shape (dim, slots, dense inputs) than
    CURRENT's: the running stack refuses it and must be restarted (`recserve down`, `recserve up`)."""
    max_quant_auc_drop: float = 0.001
    """Refuse a version served in float16 or int8 whose export measured a test AUC more than this
    below its own float32 AUC."""
    max_auc_drop: float = 0.01
    """Refuse a full version from the stream whose progressive AUC on its latest window is more
    than this below the served version's on the same samples."""
    announce: str = field(default="", metadata={"metavar": "kafka://BROKERS/TOPIC"})
    """Announce the new CURRENT on the model's notice topic (serving processes listening there with
    --notices switch at once; '': none, one host's serving sees CURRENT change by inotify)."""

    def __post_init__(self) -> None:
        if not self.version:
            raise ValueError("give the VERSION to publish")


@dataclass
class RollbackConfig:
    """``recserve rollback``."""

    store: str = store_field()
    """Model-store root."""
    model: str = "criteo"
    """Model name in the store."""
    announce: str = field(default="", metadata={"metavar": "kafka://BROKERS/TOPIC"})
    """Announce the new CURRENT on the model's notice topic (serving processes listening there with
    --notices switch at once; '': none, one host's serving sees CURRENT change by inotify)."""
    allow_schema_change: bool = False
    """Roll back to a version of another feature schema or shape than CURRENT's (the running
    stack must be restarted)."""


def _print_guards(store: str, model: str, last: int = 5) -> None:
    """The last guard events of the model's learning loop (model_store/guards.py)."""
    from model_store.guards import read_guards
    from model_store.layout import model_dir

    events, bad = read_guards(model_dir(store, model), last)
    for e in events:
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.at))
        where = f"version {e.version}" + (f" delta {e.delta}" if e.delta >= 0 else "") if e.version else ""
        back = f" back at delta {e.to}" if e.event == "rewind" else ""
        print(f"guard  {e.guard:<6} {e.event:<6} {at}  {where}{back}  {e.reason}".rstrip())
    for why in bad:
        print(f"guard  unreadable line skipped: {why}")


def _print_frontends(store: str, model: str) -> None:
    """Every `recserve serve` process of the model (each worker of a frontend of several)."""
    from serving.scoring import roster

    records = roster.read(roster.roster_dir(store, model))
    if records:
        print(f"frontends (`recserve serve`, {len(records)} process{'es' * (len(records) > 1)}):")
    for record in records:
        print(record.line())


def run_versions(cfg: VersionsConfig) -> int:
    from model_store import ModelStoreError, list_versions, pin, pins, retain, unpin
    from recserve.commands.experiment import running_line
    from serving.stack.local import default_run_dir
    from serving.stack.view import serving_view

    try:
        if cfg.pin:
            pin(cfg.store, cfg.model, cfg.pin)
        if cfg.unpin:
            unpin(cfg.store, cfg.model, cfg.unpin)
    except ModelStoreError as e:
        print(f"refused: {e}", file=sys.stderr)
        return 1
    pinned = set(pins(cfg.store, cfg.model))
    if cfg.keep:
        removed = retain(cfg.store, cfg.model, cfg.keep)
        print(f"removed: {', '.join(removed) if removed else 'nothing'}")
    rows = list_versions(cfg.store, cfg.model)
    if not rows:
        print(f"no versions of {cfg.model} in {cfg.store}")
    run_dir = cfg.run_dir or default_run_dir(cfg.store, cfg.model)
    view = serving_view(run_dir)
    current = next((r.version for r in rows if r.current), None)
    refused = _refusals(view, current) if view else {}
    for r in rows:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.created)) if r.created else "-"
        auc = f"auc={r.metrics['auc']:.4f}" if r.metrics and "auc" in r.metrics else ""
        if r.quantized is not None:
            q = r.quantized
            auc += f" {q.dtype}: auc={q.auc:.4f} (float32 {q.float32_auc:.4f}) max|score diff|={q.max_abs_score_diff:.2g}"
        if r.stream is not None:
            auc += f" {_progressive(r.stream)}"
        mark = "*" if r.current else " "
        why = f"refused by {', '.join(refused[r.version])}" if r.version in refused else ""
        gate = f"refused by the gate: {r.refused}" if r.refused else ""
        notes = " ".join(x for x in (auc, "pinned" * (r.version in pinned), r.detail, why, gate) if x)
        print(f"{mark} {r.version:>4}  {r.status:<10} {created}  deltas={r.deltas:<3} {notes}")
    if experiment := running_line(cfg.store, cfg.model):
        print(experiment)
    _print_guards(cfg.store, cfg.model)
    _print_frontends(cfg.store, cfg.model)
    if view is None:
        print(f"serving: no stack running from {run_dir}")
        return 0
    print(f"serving (stack in {view['run_dir']}):")
    runtimes = (view.get("lookups") or {}).get("runtimes")
    runtime = f", runtime {'|'.join(runtimes)}" if runtimes else ""
    devices = (view.get("lookups") or {}).get("devices")
    runtime += f" on {'|'.join(devices)}" if devices else ""
    print(f"  dense model  version {view['dense_version']} (TorchServe's default){runtime}")
    for i, shard in enumerate(view["ps"]):
        print(f"  ps shard {shard.get('shard', i)}   {shard['address']}  " + _served(shard))
        if shard.get("refusal"):
            print(f"               refuses: {shard['refusal']}")
    if view["worker"]:
        print(f"  worker       {view['worker']['address']}  " + _served(view["worker"]))
    if view.get("lookups") is not None:
        print("  lookups      " + _lookups(view["lookups"]) + " (TorchServe's handler)")
    impressions = (view.get("lookups") or {}).get("impressions")
    if impressions:
        print(f"  impressions  logged {impressions.get('logged', 0)}, dropped {impressions.get('dropped', 0)}"
              " (recserve_impressions_*_total)")  # fmt: skip
    for version, why in view["refused"].items():
        print(f"  controller   refused version {version}: {why}")
    if view.get("restarts"):
        print("  restarted    " + ", ".join(f"{name} {n}x" for name, n in sorted(view["restarts"].items())))
    return 0


def _progressive(s) -> str:
    """A full version from the stream: its progressive AUC and the served version's, same samples."""
    fmt = lambda a: "-" if a is None else f"{a:.4f}"  # noqa: E731
    return f"stream: progressive auc={fmt(s.auc)} (version {s.served_version} {fmt(s.served_auc)}, {s.samples} samples)"


def _lookups(lookups: dict) -> str:
    if "error" in lookups:
        return f"not answering: {lookups['error']}"
    if not lookups["shards"]:
        return "not reported yet"
    return ", ".join(f"shard {shard} {'|'.join(modes)}" for shard, modes in lookups["shards"].items())


def _served(part: dict) -> str:
    if "error" in part:
        return f"not answering: {part['error']}"
    return f"version {part['version'] or '(none)'} delta {part['delta_seq']}"


def _refusals(view: dict, current: str | None) -> dict[str, list[str]]:
    """version -> the serving components that refuse it. A shard's ``refusal`` is about the
    version CURRENT names."""
    out: dict[str, list[str]] = {}
    for i, shard in enumerate(view["ps"]):
        if shard.get("refusal") and current:
            who = f"ps shard {shard.get('shard', i)}"  # its replicas refuse it alike: named once
            if who not in out.get(current, []):
                out.setdefault(current, []).append(who)
    for version in view["refused"]:
        out.setdefault(version, []).append("the controller")
    return out


def run_publish(cfg: PublishConfig) -> int:
    from model_store import IncompatibleVersion, ModelStoreError, publish

    note = ""
    try:
        try:
            publish(cfg.store, cfg.model, cfg.version, max_quant_auc_drop=cfg.max_quant_auc_drop,
                    max_auc_drop=cfg.max_auc_drop)  # fmt: skip
        except IncompatibleVersion as e:
            if not cfg.allow_schema_change:
                raise
            publish(cfg.store, cfg.model, cfg.version, True, cfg.max_quant_auc_drop, cfg.max_auc_drop)
            note = (f"a schema change ({e}); a running stack keeps serving what it has and refuses "
                    f"{cfg.version}: restart it (recserve down --model {cfg.model}; recserve up --model "
                    f"{cfg.model}), and any `train --follow`")  # fmt: skip
    except ModelStoreError as e:
        print(f"refused: {e}", file=sys.stderr)
        return 1
    _announce(cfg.announce, cfg.store, cfg.model, cfg.version)
    print(f"{cfg.model}: CURRENT -> {cfg.version}")
    if note:
        print(f"note: {note}", file=sys.stderr)
    return 0


def run_rollback(cfg: RollbackConfig) -> int:
    from model_store import ModelStoreError, rollback

    try:
        v = rollback(cfg.store, cfg.model, cfg.allow_schema_change)
    except ModelStoreError as e:
        print(f"refused: {e}", file=sys.stderr)
        return 1
    _announce(cfg.announce, cfg.store, cfg.model, v)
    print(f"{cfg.model}: rolled back, CURRENT -> {v}")
    return 0


def _announce(spec: str, store: str, model: str, version: str) -> None:
    """Tell the serving processes listening on ``spec`` that CURRENT names ``version`` now."""
    import model_store as ms
    from serving import notices

    announcer = notices.announcer(spec)
    if announcer is not None:
        mdir = ms.model_dir(store, model)
        notices.announce(announcer, mdir, version, notices.VERSION, (mdir / ms.CURRENT).stat().st_mtime)
        announcer.close()


COMMANDS = {
    "versions": types.SimpleNamespace(CONFIG=VersionsConfig, run=run_versions),
    "publish": types.SimpleNamespace(CONFIG=PublishConfig, run=run_publish),
    "rollback": types.SimpleNamespace(CONFIG=RollbackConfig, run=run_rollback),
}
