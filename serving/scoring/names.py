"""The names both scoring frontends report under, and that ``recserve versions`` reads back:
light (no numpy, no torch), so the TorchServe metrics config and the stack's status read them
without loading the scoring core."""

LOOKUP_MODES = ("colocated", "remote")
FORMER_LOOKUP_MODES = {"local": "colocated"}
"""Words that named a mode before (until 0.1: ``local``), accepted where they are read back."""
"""Where one shard's rows are read (what ``ScoringConfig.lookups`` chose for it): mapped in this
process, or through the worker / PS shards."""
LOOKUP_MODE = "recserve_scoring_lookup_mode"
"""Gauge {shard, mode}: 1 for the mode a shard's rows are read in, 0 for the other."""
DENSE_RUNTIME = "recserve_scoring_dense_runtime"
"""Gauge {runtime}: 1 for the dense runtime in use, 0 for the other."""
DENSE_DEVICES = ("cpu", "cuda")
"""Where a dense model runs (``ScoringConfig.device`` resolved: ``model_store.devices``)."""
DENSE_DEVICE = "recserve_scoring_dense_device"
"""Gauge {device}: 1 for the device the dense model runs on (cpu or cuda), 0 for the other."""
ARM_REQUESTS = "recserve_scoring_arm_requests_total"
"""Counter {arm, status}: requests each arm of a running experiment answered (a shadow arm's
scorings off the response path too), by HTTP status (``serving.scoring.arms``)."""
ARM_MAPPED = "recserve_scoring_arm_mapped_bytes"
"""Gauge {arm, version}: bytes of embedding rows an arm's scorer holds mapped in this process (its
co-located shards, base and delta overlay; 0 for remote lookups), set at each switch of the split."""
SHADOW_DROPPED = "recserve_scoring_shadow_dropped_total"
"""Counter {arm}: requests a shadow arm did not score because its queue was full (under load)."""
