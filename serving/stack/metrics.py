"""The stack's /metrics endpoints: where Prometheus finds them (``write_prometheus_targets``) and
what a scoring process reports of how it scores, scraped (``lookup_modes``)."""

from __future__ import annotations

import json
from pathlib import Path

from serving.stack.state import StackState


def write_prometheus_targets(run_dir: str | Path, state: StackState) -> Path:
    """``<run_dir>/prometheus-targets.json``: every /metrics endpoint of the stack in Prometheus'
    file service discovery format (deploy/prometheus/prometheus.yml reads it), labelled by component
    (``ps0.1`` -> ``ps``)."""
    from model_store import write_atomic

    groups = [
        {"targets": [address], "labels": {"component": name.rstrip("0123456789."), "instance_name": name}}
        for name, address in sorted(state.metrics_endpoints.items())
    ]
    path = Path(run_dir) / "prometheus-targets.json"
    write_atomic(path, json.dumps(groups, indent=2).encode())
    return path


def lookup_modes(metrics_address: str, timeout_s: float = 2.0) -> dict:
    """What the scoring processes behind ``metrics_address`` (HOST:PORT of a /metrics) report of
    how they score: where they read each shard's rows (``recserve_scoring_lookup_mode == 1``) and
    their dense runtime and device (``recserve_scoring_dense_runtime == 1``,
    ``recserve_scoring_dense_device == 1``), and what their impression log
    delivered and dropped: ``{"shards": {shard: [modes]}, "runtimes": [runtimes], "devices": [devices], "impressions":
    {"logged": n, "dropped": n} or None}`` (several while versions that chose differently are loaded side by
    side), or ``{"error": why}`` when the endpoint does not answer."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from serving.scoring.impressions import DROPPED, LOGGED
    from serving.scoring.names import DENSE_DEVICE, DENSE_RUNTIME, FORMER_LOOKUP_MODES, LOOKUP_MODE

    try:
        with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=timeout_s) as r:
            text = r.read().decode()
    except OSError as e:
        return {"error": str(e)}
    modes: dict[int, set[str]] = {}
    runtimes: set[str] = set()
    devices: set[str] = set()
    impressions: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for counter, key in ((DROPPED, "dropped"), (LOGGED, "logged")):
            if family.name in (counter, counter.removesuffix("_total")):
                total = sum(s.value for s in family.samples if s.name == counter)
                impressions[key] = impressions.get(key, 0) + total
        if family.name == LOOKUP_MODE:
            for sample in family.samples:
                if sample.value == 1:
                    mode = FORMER_LOOKUP_MODES.get(
                        sample.labels["mode"], sample.labels["mode"]
                    )  # an older process's
                    modes.setdefault(int(sample.labels["shard"]), set()).add(mode)
        elif family.name == DENSE_RUNTIME:
            runtimes |= {sample.labels["runtime"] for sample in family.samples if sample.value == 1}
        elif family.name == DENSE_DEVICE:
            devices |= {sample.labels["device"] for sample in family.samples if sample.value == 1}
    return {"shards": {shard: sorted(m) for shard, m in sorted(modes.items())}, "runtimes": sorted(runtimes),
            "devices": sorted(devices),
            "impressions": {k: int(v) for k, v in impressions.items()} or None}  # fmt: skip
