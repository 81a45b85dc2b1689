"""Dense runtimes: the formats a version's dense network ships in, and their registry.

A runtime is one module of this package that calls ``register(DenseRuntime(...))`` with its
name, the file it writes in a version directory, an exporter and a loader, and the device it runs
on. A runtime may run another's export on another device (``of``: ``torchscript-cuda`` and
``cuda-graphs`` run the TorchScript file on a GPU): it writes nothing, and a version ships it
wherever it ships that file. The type and what runtimes share are in ``base``, the registry in
``registry``; the package imports every module in it (names starting with ``_`` excepted), so a
new runtime is one file here plus its test: export (``training.export_dense`` writes and verifies
every exporting runtime, ``EXPORTS``), the
manifest's ``dense`` map, the timing that names the faster one for ``--runtime auto``, and the
``--runtime`` choices of every frontend all come from ``RUNTIMES``. ``get`` refuses a name it
does not hold.

The model contract (``training.models``): inputs ``pooled`` (B, S, D) and ``dense`` (B, F)
float32, output ``logits`` (B,), batch axis dynamic. A loaded runtime is one numpy-in/numpy-out
callable (``DenseFn``) that refuses inputs of the wrong shape with a ValueError naming the
expected one (``check_inputs``).

Heavy imports (torch, onnxruntime) stay inside a runtime's functions: importing the registry to
list the choices costs nothing.
"""

from model_store.runtimes.base import (
    INPUT_NAMES,
    OUTPUT_NAME,
    DenseFn,
    DenseRuntime,
    Export,
    Load,
    as_array,
    check_inputs,
    quiet_deprecations,
    torch_threads,
)
from model_store.runtimes.registry import EXPORTS, RUNTIMES, discover, for_file, get, preload, register

__all__ = ["EXPORTS", "INPUT_NAMES", "OUTPUT_NAME", "RUNTIMES", "DenseFn", "DenseRuntime", "Export", "Load",
           "as_array", "check_inputs", "for_file", "get", "preload", "quiet_deprecations", "register",
           "torch_threads"]  # fmt: skip

discover(__name__)
