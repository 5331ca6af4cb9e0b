"""Weight gradients: accumulated into ``p.grad`` (the step's first contribution written over the
stale gradient), now or -- inside a ``WeightGrads`` scope, the W pass of a zero-bubble pipeline --
later, bitwise the same."""
from __future__ import annotations

import contextvars

from .products import matmul


def accumulate(p, g):
    """p.grad += g (g in any float dtype); the step's first contribution is copied in."""
    dst = p.write_grad()
    if dst is not None:
        dst[...] = g
    elif g.dtype == p.grad.dtype:
        p.grad += g
    else:
        p.grad += g.astype(p.grad.dtype)


# --- the backward split: input gradients now, weight gradients later (zero-bubble pipelines) ----
# the open WeightGrads scopes, innermost last: a context variable, so a backward interleaved with a
# forward (parallel/overlap.py: each strand a greenlet, with its own context) defers only its own
_SCOPES = contextvars.ContextVar("pympar_weight_grads", default=())


def deferrable(apply):
    """Run ``apply()`` (a weight-gradient update, in place) now, or -- inside a ``WeightGrads``
    scope -- when the scope's ``run()`` is called. The closure holds what the update needs (the
    layer's input and output gradient), so a deferred update keeps exactly those alive."""
    stack = _SCOPES.get()
    if stack:
        stack[-1].items.append(apply)
    else:
        apply()


def product_grad(p, a, b):
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


def weight_grad(p, compute, into=None):
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
    return bool(_SCOPES.get())


class WeightGrads:
    """The weight gradients a backward pass left for later: ``with WeightGrads() as w:`` around
    a backward collects every ``weight_grad`` inside it; ``w.run()`` computes and accumulates them
    in the order the backward met them, so the gradients are bitwise those of running them at
    once (the same products, added to each .grad in the same order)."""

    __slots__ = ("items", "_token")

    def __init__(self):
        self.items = []
        self._token = None

    def __enter__(self):
        if self._token is not None:
            raise RuntimeError("a WeightGrads scope is open already: enter a new WeightGrads()")
        self._token = _SCOPES.set(_SCOPES.get() + (self,))
        return self

    def __exit__(self, *exc):
        _SCOPES.reset(self._token)
        self._token = None
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
