"""Build a TorchServe model archive (.mar) for the recserve handler."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _ts_home() -> str:
    import ts  # the installed torchserve package; its parent dir is TorchServe's "model_server_home"

    return str(Path(ts.__file__).resolve().parent.parent)


def archive(
    handler_py: str | Path,
    extra_files: list[str | Path] | tuple[str | Path, ...],
    model_name: str,
    version: str,
    export_dir: str | Path,
    serialized_file: str | Path | None = None,
) -> Path:
    """Build ``export_dir/<model_name>-<version>.mar`` with torch-model-archiver and return its path.

    The archiver always names its output ``<model_name>.mar``; we build in a temp dir and rename,
    so several versions of one model can sit side by side in the model store.
    """
    from model_archiver.model_archiver_config import ModelArchiverConfig
    from model_archiver.model_packaging import package_model
    from model_archiver.model_packaging_utils import ModelExportUtils

    export_dir = Path(export_dir)
    export_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=export_dir, prefix=".archive-") as tmp:
        config = ModelArchiverConfig(
            model_name=model_name,
            handler=str(Path(handler_py).resolve()),
            version=version,
            serialized_file=str(Path(serialized_file).resolve()) if serialized_file else None,
            extra_files=",".join(str(Path(f).resolve()) for f in extra_files) or None,
            export_path=tmp,
            force=True,
        )
        package_model(config, manifest=ModelExportUtils.generate_manifest_json(config))
        target = export_dir / f"{model_name}-{version}.mar"
        os.replace(Path(tmp) / f"{model_name}.mar", target)  # atomic: TorchServe never sees half a file
    return target
