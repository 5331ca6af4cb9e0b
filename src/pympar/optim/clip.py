"""Global-norm gradient clipping, with a hook to sum the squares over process groups."""
from __future__ import annotations

import math

import numpy as np

from ..backend import to_numpy, xp_of


def sum_sq(g):
    """sum(g*g) as a 0-d array on g's device (float16 squared in float32)."""
    g = g.reshape(-1)
    xp = xp_of(g)
    return xp.dot(g, g) if g.dtype != np.float16 else xp.dot(g.astype(np.float32), g)


def sum_of_squares(arrays) -> float:
    """sum(g*g) over every array, on the host: each array's sum on its device, one transfer, then
    added in order (the same bits wherever the arrays live)."""
    sq = 0.0
    for term in host_scalars([sum_sq(g) for g in arrays if g.size]):   # one device->host copy on a GPU
        sq += float(term)
    return sq


def host_scalars(terms):
    """The 0-d device arrays as host scalars, in order, with one transfer."""
    if not terms:
        return []
    xp = xp_of(terms[0])
    return list(to_numpy(xp.stack([xp.asarray(t, dtype=np.float64) for t in terms])))


def clip_coefficient(norm: float, max_norm) -> float | None:
    """The factor that brings gradients of global L2 norm ``norm`` to at most max_norm, or None when
    they stay as they are: no clipping asked (max_norm 0 or None), a norm within it, or a non-finite
    norm (the loss scaler decides). The one clipping rule of every gradient path."""
    if max_norm and max_norm > 0 and math.isfinite(norm) and norm > max_norm:
        return max_norm / (norm + 1e-6)
    return None


def clip_grad_norm(params, max_norm, allreduce_sq=None) -> float:
    """Scale every .grad so the global L2 norm is at most max_norm; return the norm before.

    allreduce_sq(local_sum_of_squares: float) -> float sums over the ranks that hold
    different parts of the gradient (None: single process). A non-finite norm is returned
    as is and the grads are left untouched (the loss scaler decides what to do).
    """
    sq = sum_of_squares([p.grad for p in params])
    if allreduce_sq is not None:
        sq = float(allreduce_sq(sq))
    norm = math.sqrt(sq) if sq >= 0 else float("nan")
    coef = clip_coefficient(norm, max_norm)
    if coef is not None:
        for p in params:
            p.grad *= p.grad.dtype.type(coef)
    return norm
