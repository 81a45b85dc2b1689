"""What the model store's tests share: versions of a model (``m`` unless named) written straight
into a store."""

from __future__ import annotations

import model_store as ms


def write_version(root, fingerprint="fp", complete=True, dim=8, num_dense=13, stream=None, model="m") -> str:
    """The next version of ``model`` (a 100-byte payload, a manifest of a DLRM over 26 slots),
    sealed (``complete``) or renamed into place without its _SUCCESS; its name."""
    v = ms.next_version(root, model)
    staging = ms.staging_dir(root, model, v)
    (staging / "payload.bin").write_bytes(b"x" * 100)
    config = {"kind": "dlrm", "dim": dim, "num_slots": 26, "num_dense": num_dense}
    ms.write_manifest(
        staging,
        ms.VersionManifest(model, v, fingerprint, dim, num_shards=1, model_config=config, stream=stream),
    )
    if complete:
        ms.seal(staging, ms.version_dir(root, model, v))
    else:
        staging.rename(ms.version_dir(root, model, v))
    return v
