"""Global-norm gradient clipping, with a hook to sum the squares over process groups."""
from __future__ import annotations

import math

import numpy as np


def clip_grad_norm(params, max_norm, allreduce_sq=None) -> float:
    """Scale every .grad so the global L2 norm is at most max_norm; return the norm before.

    allreduce_sq(local_sum_of_squares: float) -> float sums over the ranks that hold
    different parts of the gradient (None: single process). A non-finite norm is returned
    as is and the grads are left untouched (the loss scaler decides what to do).
    """
    sq = 0.0
    for p in params:
        g = p.grad.reshape(-1)
        sq += float(np.dot(g, g)) if g.dtype != np.float16 else float(np.dot(g.astype(np.float32), g))
    if allreduce_sq is not None:
        sq = float(allreduce_sq(sq))
    norm = math.sqrt(sq) if sq >= 0 else float("nan")
    if max_norm and max_norm > 0 and math.isfinite(norm) and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for p in params:
            p.grad *= np.asarray(coef, dtype=p.grad.dtype)
    return norm
