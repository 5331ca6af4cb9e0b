"""Parameters, deterministic initialisation and the tiny module protocol.

Gradient convention (the whole of pympar.nn follows it):
  * ``forward(x) -> (y, ctx)``; ctx holds exactly what backward needs (no tape, no globals);
  * ``backward(dy, ctx) -> dx``: parameter gradients are ACCUMULATED (``p.grad += ...``, through
    ``accumulate`` / ``weight_grad``, which write the step's first contribution over the
    gradient ``zero_grad`` left stale), activation gradients are RETURNED fresh (``dx = ...``);
  * master weights (``p.data``) and their grads are float32 or float64; a module built with a
    lower ``compute_dtype`` casts weights and activations to it for the arithmetic and adds
    its grads back into the master-precision ``p.grad``.
"""
from __future__ import annotations

import contextlib

import numpy as np

from .. import kernels
from ..kernels import gemm
from ..backend import dtype as backend_dtype
from ..backend import is_low_precision, lowp_gemm, to_device, xp_of
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
        if _COPIES:                              # a replaced array (ZeRO-3's release): its copy goes too
            _COPIES.pop(id(self), None)

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


class Module:
    """Base: children and parameters found by attribute order; names are nanoGPT's."""

    def backward_input(self, dy, ctx, *args):
        """backward split in two (zero-bubble pipelines): the input gradient now, the weight
        gradients the module can defer kept for ``backward_weight(ctx)`` (the caller keeps ctx
        until then). Running both gives bitwise the gradients of ``backward(dy, ctx, *args)``."""
        with WeightGrads() as w:
            dx = self.backward(dy, ctx, *args)
        self.__dict__.setdefault("_w_pending", {})[id(ctx)] = w
        return dx

    def backward_weight(self, ctx):
        """The weight gradients ``backward_input(dy, ctx)`` deferred, accumulated now."""
        self.__dict__.get("_w_pending", {}).pop(id(ctx)).run()

    def forward_backward(self, inputs, dy, kept=None):
        """forward then backward at once, for a last operation whose output gradient dy is known
        before its forward (a loss). A module that can do better in one pass (the chunked head)
        overrides it; kept (a list, optional) gets what the pass holds (for the activation count)."""
        out, ctx = self.forward(inputs)
        if kept is not None:
            kept.append(ctx)
        return out, self.backward(dy, ctx)

    def _children(self):
        for key, val in vars(self).items():
            if key.startswith("_"):
                continue
            if isinstance(val, Parameter):
                yield key, val
            elif isinstance(val, Module):
                yield key, val
            elif isinstance(val, (list, tuple)) and val and all(isinstance(m, Module) for m in val):
                for i, m in enumerate(val):
                    yield f"{key}.{i}", m

    def named_parameters(self, prefix: str = ""):
        """Yield (dotted name, Parameter); a Parameter object reached twice is yielded once."""
        seen = set()
        for name, p in self._named_parameters(prefix):
            if id(p) not in seen:
                seen.add(id(p))
                yield name, p

    def _named_parameters(self, prefix):
        for key, val in self._children():
            full = f"{prefix}.{key}" if prefix else key
            if isinstance(val, Parameter):
                yield full, val
            else:
                yield from val._named_parameters(full)

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def zero_grad(self):
        for p in self.parameters():
            p.zero_grad()

    def modules(self):
        """This module and every sub-module below it (depth first, each once)."""
        seen, stack = set(), [self]
        while stack:
            m = stack.pop()
            if id(m) in seen:
                continue
            seen.add(id(m))
            yield m
            stack.extend(v for _, v in reversed(list(m._children())) if isinstance(v, Module))

    def to(self, device: str):
        """Move every parameter (data and grad, tied ones once) and buffer to 'cpu' or 'cuda'
        in place; returns self. Build on the host, then move: initial values are device-free."""
        for _, p in self.named_parameters():
            p.data = to_device(p.data, device)
            if p.has_grad:
                p.grad = to_device(p.grad, device)
        for m in self.modules():
            m.move_buffers(device)
        return self

    def move_buffers(self, device: str):
        """Arrays a module keeps besides its Parameters (MoE: the expert selection bias)."""


class NoGather:
    """The parameter scope of a model whose parameters are whole on this rank: nothing to do.

    A ZeRO-3 layout replaces it (pympar.parallel.zero.ParamGather): ``use(module)`` then holds
    the module's full parameters for the body of the ``with``."""

    enabled = False

    @contextlib.contextmanager
    def use(self, *modules, backward=False):
        yield

    def settle(self):
        """End of a pass: nothing in flight."""


def resolve_precision(dtype, compute_dtype, model: str = "GPT"):
    """(master dtype, compute dtype or None) of a model: master float32/float64; compute
    'float16'/'bfloat16' (or a dtype) for mixed precision, None when it equals the master."""
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise ValueError(f"master dtype {dtype} is not supported by {model}: use float32 or float64 "
                         "(and compute_dtype='float16'/'bfloat16' for mixed precision)")
    cdt = None if compute_dtype is None else backend_dtype(compute_dtype)
    return dtype, (None if cdt == dtype else cdt)


def compute_cast(a, cdt):
    """``a`` in the compute dtype (no copy when it already is)."""
    return a if cdt is None or a.dtype == cdt else kernels.cast(a, cdt)


# --- the weight cache: one compute-dtype copy of each weight per step --------------------------
_COPIES = None          # inside a compute_copies() scope: id(Parameter) -> (its data, the copy)


@contextlib.contextmanager
def compute_copies():
    """A scope in which the weights do not change (the forward and backward passes of one optimizer
    step, every micro-batch): ``compute_weight`` casts each weight to the compute dtype once and
    reuses the copy (PyTorch autocast's weight cache), and a bf16 copy is packed once for MKL
    (kernels.gemm.packable). Leaving the scope lets the copies go; outside one, every call casts.
    Nested scopes share the outermost's copies."""
    global _COPIES
    if _COPIES is not None:
        yield
        return
    _COPIES = {}
    try:
        yield
    finally:
        _COPIES = None


def compute_weight(p: Parameter, cdt):
    """p's data in the compute dtype ``cdt`` (the data itself when it already is, or cdt is None):
    inside ``compute_copies``, the same copy for every call until the scope ends (a data array that
    was replaced -- a ZeRO-3 gather -- is cast again)."""
    d = p.data
    if cdt is None or d.dtype == cdt:
        return d
    if _COPIES is None:
        return kernels.cast(d, cdt)
    hit = _COPIES.get(id(p))
    if hit is not None and hit[0] is d:
        return hit[1]
    w = kernels.cast(d, cdt)
    if type(w) is np.ndarray and w.ndim == 2:
        gemm.packable(w)
    _COPIES[id(p)] = (d, w)
    return w


def matmul(a, b, out_dtype=None, out=None, accumulate=False):
    """a @ b; float16/bfloat16 operands are multiplied with float32 accumulation (like tensor
    cores; on CuPy by cuBLAS on the tensor cores themselves) and the product rounded to
    ``out_dtype`` (default: the operands' dtype). ``out``: an array (a view is fine, e.g. one
    slot of a packed tensor) of the product's shape and dtype to write into; it is returned.

    One difference between the devices: on NumPy the float32 product is rounded once, to
    out_dtype (a float32 out_dtype keeps it whole); cuBLAS through CuPy returns the product in
    the operands' dtype, so on a GPU a wider out_dtype (weight gradients, tensor-parallel
    partial sums) widens an already-rounded product -- what PyTorch autocast does too. The GPU
    tests compare low-precision runs within bf16/fp16 tolerance for this reason.

    ``accumulate=True``: out += a @ b (out required, of the product's shape). MKL adds the product
    in the GEMM itself (beta = 1: no temporary, no second pass over out); elsewhere the product
    is formed (in out's dtype) and added, as ``accumulate`` below does."""
    if accumulate:
        if out is None:
            raise ValueError("matmul: accumulate=True needs an out to add the product to")
        if type(a) is np.ndarray and out.dtype == a.dtype and \
                gemm.product(a, b, out, kernels.get_num_threads(), accumulate=True) is not None:
            return out
        if type(a) is np.ndarray and is_low_precision(a.dtype) and \
                gemm.product_bf16(a, b, out, kernels.get_num_threads(), accumulate=True) is not None:
            return out
        out += matmul(a, b, out.dtype)
        return out
    if is_low_precision(a.dtype) and not lowp_gemm(a):   # NumPy: no float16/bf16 GEMM of its own
        y = _bf16_product(a, b, out_dtype, out)                       # the CPU's matrix engines (MKL)
        if y is not None:
            return y
        # no native bf16 products here: widened exactly to float32, multiplied there, rounded once
        y = matmul(kernels.cast(a, np.float32), kernels.cast(b, np.float32))
        if out is not None:
            out[...] = y if out.dtype == y.dtype else kernels.cast(y, out.dtype)
            return out
        dt = np.dtype(out_dtype or a.dtype)
        return y if dt == y.dtype else kernels.cast(y, dt)
    if out is not None and out_dtype is not None and out.dtype != out_dtype:
        raise ValueError(f"matmul: out has dtype {out.dtype}, out_dtype asks for {out_dtype}")
    if type(a) is np.ndarray and (out_dtype is None or out_dtype == a.dtype):   # MKL, where selected
        y = gemm.product(a, b, out, kernels.get_num_threads())
        if y is not None:
            return y
    if out is not None:
        if out.dtype == a.dtype:
            return xp_of(a).matmul(a, b, out=out)   # BLAS writes a strided view directly
        out[...] = a @ b
        return out
    y = a @ b
    return y if out_dtype is None else y.astype(out_dtype, copy=False)


def _bf16_product(a, b, out_dtype, out, bias=None, gelu_out=None):
    """a @ b (+ bias, and GELU of it into gelu_out) on MKL's bf16 GEMM for NumPy bf16 operands, into
    ``out`` or a new array of ``out_dtype`` (bf16 by default, or float32); None when it cannot run
    there (no MKL, a layout it cannot read): the caller takes another path."""
    if type(a) is not np.ndarray or type(b) is not np.ndarray or a.ndim != 2 or b.ndim != 2:
        return None
    if out is None:
        dt = np.dtype(out_dtype) if out_dtype is not None else a.dtype
        if dt == np.float32:
            out = np.empty((a.shape[0], b.shape[1]), np.float32)
        elif dt != a.dtype:
            return None
    return gemm.product_bf16(a, b, out, kernels.get_num_threads(), bias=bias, gelu_out=gelu_out)


def linear_bf16(x2, wt, out=None, bias=None, gelu_out=None):
    """x2 (N, in) @ wt (in, out) in bf16 with its epilogue fused: round(x2 wt + bias) and, with
    ``gelu_out``, round(GELU(that)) too; None where MKL's bf16 GEMM cannot run it."""
    return _bf16_product(x2, wt, None, out, bias, gelu_out)


def accumulate(p: Parameter, g):
    """p.grad += g (g in any float dtype); the step's first contribution is copied in."""
    dst = p.write_grad()
    if dst is not None:
        dst[...] = g
    elif g.dtype == p.grad.dtype:
        p.grad += g
    else:
        p.grad += g.astype(p.grad.dtype)


# --- the backward split: input gradients now, weight gradients later (zero-bubble pipelines) ----
_DEFERRED = []          # a stack of open WeightGrads scopes (innermost last)


def deferrable(apply):
    """Run ``apply()`` (a weight-gradient update, in place) now, or -- inside a ``WeightGrads``
    scope -- when the scope's ``run()`` is called. The closure holds what the update needs (the
    layer's input and output gradient), so a deferred update keeps exactly those alive."""
    if _DEFERRED:
        _DEFERRED[-1].items.append(apply)
    else:
        apply()


def product_grad(p: Parameter, a, b):
    """p.grad += a @ b (a weight gradient that is one product, e.g. dy^T x), now or deferred
    (``deferrable``): the step's first contribution is written straight into the gradient, a
    later one (the next micro-batch, row block or chunk) is added to it by the GEMM itself where
    the library can (``matmul(accumulate=True)``) -- no temporary and no addition either way."""
    def apply():
        dst = p.write_grad()
        if dst is not None:
            matmul(a, b, dst.dtype, out=dst)
        else:
            matmul(a, b, out=p.grad, accumulate=True)
    deferrable(apply)


def weight_grad(p: Parameter, compute, into=None):
    """p.grad += compute(), now or deferred (``deferrable``). ``into(out)`` (optional): the same
    product written into ``out`` -- the step's first contribution goes straight into the
    gradient, without a temporary and an addition."""
    def apply():
        dst = p.write_grad() if into is not None else None
        if dst is not None:
            into(dst)
        else:
            accumulate(p, compute())
    deferrable(apply)


def deferring() -> bool:
    """True inside a WeightGrads scope (weight gradients wait for its run())."""
    return bool(_DEFERRED)


class WeightGrads:
    """The weight gradients a backward pass left for later: ``with WeightGrads() as w:`` around
    a backward collects every ``weight_grad`` inside it; ``w.run()`` computes and accumulates them
    in the order the backward met them, so the gradients are bitwise those of running them at
    once (the same products, added to each .grad in the same order)."""

    __slots__ = ("items",)

    def __init__(self):
        self.items = []

    def __enter__(self):
        _DEFERRED.append(self)
        return self

    def __exit__(self, *exc):
        _DEFERRED.remove(self)
        return False

    def run(self):
        items, self.items = self.items, []
        for apply in items:
            apply()

    @property
    def nbytes(self) -> int:
        """Bytes the deferred updates keep alive (the arrays their closures hold, each once)."""
        from ..backend import held_bytes
        return held_bytes([_closed_over(f) for f in self.items])


def _closed_over(f, depth=3):
    """The values a closure holds (and those of the closures it holds, a few levels down)."""
    out = []
    for cell in f.__closure__ or ():
        v = cell.cell_contents
        out.append(_closed_over(v, depth - 1) if callable(v) and depth and getattr(v, "__closure__", None) else v)
    return out
