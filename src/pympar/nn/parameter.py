"""Parameters and their deterministic initialisation.

Gradient convention (the whole of pympar.nn follows it):
  * ``forward(x) -> (y, ctx)``; ctx holds exactly what backward needs (no tape, no globals);
  * ``backward(dy, ctx) -> dx``: parameter gradients are ACCUMULATED (``p.grad += ...``, through
    ``accumulate`` / ``weight_grad`` of nn/wgrad.py, which write the step's first contribution over
    the gradient ``zero_grad`` left stale), activation gradients are RETURNED fresh (``dx = ...``);
  * master weights (``p.data``) and their grads are float32 or float64; a module built with a
    lower ``compute_dtype`` casts weights and activations to it for the arithmetic (nn/products.py)
    and adds its grads back into the master-precision ``p.grad``.

The module protocol is nn/module.py, the products in the compute dtype nn/products.py, the
weight gradients (and their deferral for zero-bubble pipelines) nn/wgrad.py.
"""
from __future__ import annotations

import numpy as np

from ..backend import xp_of
from . import products
from .init import normal_slice


class Parameter:
    """A master weight ``data`` and its gradient ``grad`` (same shape and dtype, zeros).

    ``shard``: which part of the full tensor named ``name`` this Parameter holds (a
    pympar.parallel.shard.Shard), None when it holds all of it. ``placement``: where the
    tensor lives on the process mesh (pympar.parallel.placement), set by the parallel layer.
    ``init``: the recipe of the initial values (an InitSpec): the data is produced from it on
    first use, for exactly the part ``shard`` names, so a layout can decide what a rank holds
    before anything is allocated. ``grad`` is allocated (zeros) on first use and may be
    released (``release_grad``) by a gradient sync that keeps only a shard of it (ZeRO-2/3).
    ``grad_shape``: the gradient's shape where it is not the data's -- ZeRO-3, whose data is this
    rank's rows outside a gather scope while the gradient is the whole (tp-local) tensor's, so a
    weight gradient deferred past the scope (a zero-bubble W pass) still has its full shape.

    ``zero_grad`` does not write zeros: it marks the gradient stale, and the first contribution of
    the next step is written over it (``write_grad``: a weight-gradient GEMM straight into it,
    ``accumulate``: a copy) instead of added to zeros; reading ``grad`` while stale (a parameter
    no contribution reached, e.g. an expert without tokens) gives zeros. The numbers are those of
    zeros plus the contribution, up to the sign of a zero."""

    __slots__ = ("_data", "_grad", "name", "shard", "placement", "init", "grad_shape", "_stale")

    def __init__(self, data=None, grad=None, name="", shard=None, init=None):
        if data is None and init is None:
            raise ValueError(f"Parameter {name!r}: give its data or an init recipe")
        self._data, self._grad, self.name = data, grad, name
        self.shard, self.init, self.placement = shard, init, None
        self.grad_shape = None
        self._stale = False

    @property
    def data(self):
        if self._data is None:
            self._data = self.init.materialize(self.shard)
        return self._data

    @data.setter
    def data(self, value):
        self._data = value
        products.forget(self)                    # a replaced array (ZeRO-3's release): its copy goes too

    @property
    def materialized(self) -> bool:
        return self._data is not None

    @property
    def grad(self):
        if self._grad is None:
            d = self.data
            self._grad = xp_of(d).zeros(self.grad_shape or d.shape, dtype=d.dtype)
        elif self._stale:
            self._grad[...] = 0
            self._stale = False
        return self._grad

    @grad.setter
    def grad(self, value):
        self._grad, self._stale = value, False

    def write_grad(self):
        """The gradient buffer to write (not add) this step's first contribution into, or None
        when a contribution is there already (add to ``grad`` then). The caller writes all of it."""
        if self._stale:
            self._stale = False
            return self._grad
        return None

    def fresh_grad(self):
        """The gradient array when it holds a contribution since the last zero_grad, else None
        (released, or zeroed lazily and not written since)."""
        return None if self._grad is None or self._stale else self._grad

    @property
    def has_grad(self) -> bool:
        """False while the gradient is released (it reads as zeros when next used)."""
        return self._grad is not None

    def release_grad(self):
        self._grad, self._stale = None, False

    def zero_grad(self):
        if self._grad is not None:
            self._stale = True                   # zeros when read, or written over (see above)

    @property
    def shape(self):
        if self._data is not None:
            return self._data.shape
        return self.shard.local_shape if self.shard is not None else self.init.full_shape

    @property
    def dtype(self):
        return self._data.dtype if self._data is not None else self.init.dtype

    @property
    def full_shape(self):
        """Shape of the whole tensor ``name`` (this Parameter may hold a part of it)."""
        return self.shard.full_shape if self.shard is not None else tuple(self.shape)

    def __repr__(self):
        part = f", full={self.shard.full_shape}" if self.shard is not None else ""
        return f"Parameter({self.name!r}, shape={tuple(self.shape)}{part})"


def default_std(name: str, n_layer: int) -> float:
    """GPT-2 initialisation scale for a weight: 0.02, residual projections 0.02/sqrt(2 n_layer)."""
    if name.endswith("c_proj.weight"):
        return 0.02 / (2 * n_layer) ** 0.5
    return 0.02


def _init_kind(name: str) -> str:
    leaf = name.rsplit(".", 1)[-1]
    owner = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
    if leaf == "bias" or name.endswith("expert_bias"):
        return "zeros"
    if leaf == "weight" and owner.startswith("ln"):
        return "ones"
    return "normal"


def init_param(seed: int, name: str, full_shape, dtype=np.float32, std: float = 0.02, shard=None):
    """The initial values of parameter ``name``: a function of (seed, name, full_shape) only.

    Biases and LayerNorm biases are zeros, LayerNorm weights ones, everything else
    normal(0, std) drawn in float64 (pympar.nn.init: addressed by element) and rounded to
    ``dtype``. ``shard`` (a Shard of full_shape, or None for the whole tensor): only that part
    is produced -- equal to the full tensor's part, and the full tensor never exists."""
    full_shape = tuple(int(s) for s in full_shape)
    local = shard.local_shape if shard is not None else full_shape
    kind = _init_kind(name)
    if kind == "zeros":
        return np.zeros(local, dtype=dtype)
    if kind == "ones":
        return np.ones(local, dtype=dtype)
    pieces = shard.pieces() if shard is not None else [(tuple((0, n) for n in full_shape),) * 2]
    return normal_slice(seed, name, full_shape, pieces, local, dtype, std)


class InitSpec:
    """How to make a parameter's initial values: init_param(seed, name, full_shape, dtype, std)."""

    __slots__ = ("seed", "name", "full_shape", "dtype", "std")

    def __init__(self, seed, name, full_shape, dtype=np.float32, std=0.02):
        self.seed, self.name, self.dtype, self.std = int(seed), name, np.dtype(dtype), float(std)
        self.full_shape = tuple(int(s) for s in full_shape)

    def materialize(self, shard=None):
        return init_param(self.seed, self.name, self.full_shape, self.dtype, self.std, shard=shard)


def make_param(seed: int, name: str, full_shape, dtype=np.float32, std: float = 0.02, shard=None):
    """A Parameter of ``shard`` (None: all) of tensor ``name``, its values made on first use."""
    return Parameter(name=name, shard=shard, init=InitSpec(seed, name, full_shape, dtype, std))
