"""The stack's /metrics endpoints as its tools read them (serving/stack/metrics.py)."""


def test_lookup_modes_reads_what_a_scoring_process_reports_and_says_when_it_does_not_answer():
    """``recserve versions``' lookups line and dense runtime: the modes a /metrics reports as 1,
    per shard; several while versions that chose differently are loaded; the runtime reported as
    1 (a mode's former name, ``local``, read as its name now); the impression log's counters (its line); the error when nothing answers there."""
    from prometheus_client import CollectorRegistry, Counter, Gauge

    from serving.rpc.metrics import start_metrics_server
    from serving.rpc.procs import free_ports
    from serving.stack.metrics import lookup_modes

    registry = CollectorRegistry()
    modes = Gauge("recserve_scoring_lookup_mode", "mode", ["shard", "mode"], registry=registry)
    for shard, local, remote in ((0, 1, 0), (1, 1, 1)):
        # shard 0 as a process before the rename reports it ("local"): read as "colocated"
        modes.labels(str(shard), "local" if shard == 0 else "colocated").set(local)
        modes.labels(str(shard), "remote").set(remote)
    runtime = Gauge("recserve_scoring_dense_runtime", "runtime", ["runtime"], registry=registry)
    runtime.labels("torchscript").set(0)
    runtime.labels("onnx").set(1)
    device = Gauge("recserve_scoring_dense_device", "device", ["device"], registry=registry)
    device.labels("cpu").set(1)
    device.labels("cuda").set(0)
    Counter("recserve_impressions_dropped", "dropped", ["topic"], registry=registry).labels("imps").inc(3)
    Counter("recserve_impressions_logged", "logged", ["topic"], registry=registry).labels("imps").inc(7)
    port, closed = free_ports(2)
    stop = start_metrics_server(port, "127.0.0.1", registry)
    try:
        assert lookup_modes(f"127.0.0.1:{port}") == {
            "shards": {0: ["colocated"], 1: ["colocated", "remote"]},
            "runtimes": ["onnx"],
            "devices": ["cpu"],
            "impressions": {"dropped": 3, "logged": 7},
        }
    finally:
        stop()
    assert "refused" in lookup_modes(f"127.0.0.1:{closed}")["error"]
