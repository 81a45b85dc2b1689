"""Sparse optimizers of the PS, vectorised over the rows one update touches, and their registry.

The store gathers the touched rows and their state into float32 matrices, calls ``apply`` and
scatters the results back, so an optimizer is a few whole-array numpy expressions. SGD and
Adagrad follow ``torch.optim.SGD`` / ``torch.optim.Adagrad`` operation by operation (same float32
expressions in the same order) because training results are compared with in-memory torch
models; Adam is lazy Adam as ``torch.optim.SparseAdam`` (moments and the parameter change only
on rows with a gradient; the bias correction uses the shard's step count); FTRL is
FTRL-Proximal, per coordinate, as in McMahan et al. 2013 ("Ad Click Prediction"), Algorithm 1.

``OPTIMIZERS`` is the one list of optimizer names: the PS update, its optional compiled fast
path, the state matrices a shard allocates and dumps, the ``--optimizer`` choices and the in-process
trainer's torch counterpart (with its hyper-parameters, ``torch_args``) all come from it, and
``get`` refuses a name it does not hold. ``OptimizerSpec`` holds every hyper-parameter of every
optimizer; it is nested in ``serving.ps.spec.TableSpec``, so each of its fields is a flag of
``recserve train`` and ``recserve ps`` and is written into every shard dump's meta. A new optimizer
is one ``@register`` function here, plus a field of ``OptimizerSpec`` for a hyper-parameter of its
own, optionally with a fused kernel (``serving.ps.fused`` says its contract) named by its entry.
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

Update = Callable[["OptimizerSpec", np.ndarray, dict[str, np.ndarray], np.ndarray, int], None]
Hyper = Callable[["OptimizerSpec", int], tuple[float, ...]]


@dataclass(frozen=True)
class SparseOptimizer:
    """One registered optimizer: its per-row state matrices and its update."""

    name: str
    state: tuple[str, ...]
    """Names of the per-row state matrices (each (rows, dim) float32), in dump order."""
    update: Update
    """``update(cfg, params, state, grads, step)``: see ``apply``."""
    initial: Callable[[OptimizerSpec, str], float]
    """The value a new row's state matrix (by name) starts at."""
    torch: str | None
    """The ``torch.optim`` class that is its counterpart on sparse gradients (the in-process
    baseline trains with it), or None when torch has none."""
    torch_args: Callable[[OptimizerSpec], dict[str, object]]
    """The counterpart's keyword arguments for a spec (its hyper-parameters as torch names them)."""
    fused: str | None = None
    """Its fast path: "module:function" of a compiled kernel that finds each distinct sign's row
    and applies ``update`` to it in one pass, to the same bits (``serving.ps.fused``); imported
    on first use, so naming it loads no compiler. None: the store gathers, updates, scatters."""
    hyper: Hyper = lambda cfg, step: ()
    """``hyper(cfg, step)``: the fused kernel's hyper-parameters, in its order."""

    def kernel(self) -> Callable[..., int] | None:
        """The fused kernel ``fused`` names (None without one)."""
        return None if self.fused is None else _resolve(self.fused)


@functools.cache
def _resolve(ref: str) -> Callable[..., int]:
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


OPTIMIZERS: dict[str, SparseOptimizer] = {}


def register(
    name: str,
    state: tuple[str, ...] = (),
    torch: str | None = None,
    initial: Callable[[OptimizerSpec, str], float] = lambda cfg, name: 0.0,
    torch_args: Callable[[OptimizerSpec], dict[str, object]] = lambda cfg: {"lr": cfg.lr},
    fused: str | None = None,
    hyper: Hyper = lambda cfg, step: (),
) -> Callable[[Update], Update]:
    """Decorator: register ``update`` as the sparse optimizer ``name`` (``fused``, ``hyper``: its
    optional fast path, see ``SparseOptimizer``)."""

    def add(update: Update) -> Update:
        if name in OPTIMIZERS:
            raise ValueError(f"optimizer {name!r} registered twice")
        OPTIMIZERS[name] = SparseOptimizer(
            name, tuple(state), update, initial, torch, torch_args, fused, hyper
        )
        return update

    return add


def get(name: str) -> SparseOptimizer:
    """The optimizer registered as ``name``; a ValueError naming the known ones otherwise."""
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"unknown optimizer {name!r}; known optimizers: {', '.join(OPTIMIZERS)}") from None


@dataclass
class OptimizerSpec:
    """A sparse optimizer and its hyper-parameters (fields an optimizer does not use are ignored).
    Nested in ``serving.ps.spec.TableSpec``: each field is a flag (``--optimizer``, ``--lr``, ...)."""

    name: str = field(default="adagrad", metadata={"flag": "optimizer", "choices": OPTIMIZERS.keys()})
    """Sparse optimizer (the names registered in serving/ps/optim.py)."""
    lr: float = 0.01
    """Learning rate (FTRL: alpha)."""
    eps: float | None = None
    """Denominator epsilon; None means the torch default (Adagrad 1e-10, Adam 1e-8)."""
    initial_accumulator_value: float = 0.0
    """Adagrad: initial value of the squared-gradient sum (torch's argument of the same name)."""
    beta1: float = 0.9
    """Adam: first-moment decay."""
    beta2: float = 0.999
    """Adam: second-moment decay."""
    l1: float = 0.0
    """FTRL: L1 regularisation strength (lambda_1)."""
    l2: float = 0.0
    """FTRL: L2 regularisation strength (lambda_2)."""
    ftrl_beta: float = 1.0
    """FTRL: the beta of the per-coordinate learning rate alpha / (beta + sqrt(n))."""

    def __post_init__(self) -> None:
        get(self.name)
        if not self.lr > 0:
            raise ValueError(f"learning rate must be > 0, got {self.lr}")

    @property
    def state_names(self) -> tuple[str, ...]:
        return get(self.name).state

    def initial_state(self, name: str) -> float:
        return get(self.name).initial(self, name)


def apply(
    cfg: OptimizerSpec, params: np.ndarray, state: dict[str, np.ndarray], grads: np.ndarray, step: int
) -> None:
    """One update of the gathered rows ``params`` (k, dim) and their ``state`` in place, with the
    already coalesced ``grads`` (k, dim); ``step`` >= 1 is the optimizer step (Adam only)."""
    get(cfg.name).update(cfg, params, state, grads, step)


def _eps(cfg: OptimizerSpec, default: float) -> float:
    return default if cfg.eps is None else cfg.eps


@register("sgd", torch="SGD", fused="serving.ps.fused:sgd", hyper=lambda cfg, step: (cfg.lr,))
def _sgd(cfg: OptimizerSpec, params, state, grads, step: int) -> None:
    # torch: param.add_(grad, alpha=-lr)
    params += np.float32(-cfg.lr) * grads


def _adagrad_args(cfg: OptimizerSpec) -> dict[str, object]:
    eps = {} if cfg.eps is None else {"eps": cfg.eps}
    return {"lr": cfg.lr, "initial_accumulator_value": cfg.initial_accumulator_value, **eps}


def _adam_args(cfg: OptimizerSpec) -> dict[str, object]:
    eps = {} if cfg.eps is None else {"eps": cfg.eps}
    return {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), **eps}


@register(
    "adagrad", state=("sum",), torch="Adagrad", initial=lambda cfg, name: cfg.initial_accumulator_value,
    torch_args=_adagrad_args, fused="serving.ps.fused:adagrad", hyper=lambda cfg, step: (cfg.lr, _eps(cfg, 1e-10)),
)  # fmt: skip
def _adagrad(cfg: OptimizerSpec, params, state, grads, step: int) -> None:
    # torch: state_sum.addcmul_(grad, grad, value=1); std = state_sum.sqrt().add_(eps);
    #        param.addcdiv_(grad, std, value=-clr)
    f32 = np.float32
    eps = f32(_eps(cfg, 1e-10))
    s = state["sum"]
    s += grads * grads
    std = np.sqrt(s)
    std += eps
    params += f32(-cfg.lr) * grads / std


@register("adam", state=("exp_avg", "exp_avg_sq"), torch="SparseAdam", torch_args=_adam_args)
def _sparse_adam(cfg: OptimizerSpec, params, state, grads, step: int) -> None:
    # torch.optim.SparseAdam, on the rows present in the gradient
    f32 = np.float32
    eps = f32(_eps(cfg, 1e-8))
    m, v = state["exp_avg"], state["exp_avg_sq"]
    m_update = (grads - m) * f32(1 - cfg.beta1)
    v_update = (grads * grads - v) * f32(1 - cfg.beta2)
    numer = m_update + m
    denom = np.sqrt(v_update + v)
    m += m_update
    v += v_update
    denom += eps
    bc1 = 1 - cfg.beta1**step
    bc2 = 1 - cfg.beta2**step
    step_size = cfg.lr * math.sqrt(bc2) / bc1
    params += f32(-step_size) * (numer / denom)


@register("ftrl", state=("z", "n"))
def _ftrl(cfg: OptimizerSpec, params, state, grads, step: int) -> None:
    # McMahan et al. 2013, Algorithm 1 (per coordinate), with the current row as w_t
    f32 = np.float32
    z, n = state["z"], state["n"]
    alpha = f32(cfg.lr)
    g2 = grads * grads
    n_new = n + g2
    sigma = (np.sqrt(n_new) - np.sqrt(n)) / alpha
    z += grads - sigma * params
    n[...] = n_new
    shrunk = z - np.sign(z) * f32(cfg.l1)
    w = -shrunk / ((f32(cfg.ftrl_beta) + np.sqrt(n)) / alpha + f32(cfg.l2))
    params[...] = np.where(np.abs(z) <= f32(cfg.l1), f32(0.0), w)
