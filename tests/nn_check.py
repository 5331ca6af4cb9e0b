"""Helpers for the engine tests: finite differences and relative errors (float64)."""
from __future__ import annotations

import numpy as np


def rel_err(a, b) -> float:
    """||a - b|| / max(||a||, ||b||) (0 when both are 0)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    den = max(np.linalg.norm(a), np.linalg.norm(b))
    return float(np.linalg.norm(a - b) / den) if den else 0.0


def sample_indices(shape, n, rng):
    size = int(np.prod(shape))
    flat = rng.choice(size, size=min(n, size), replace=False)
    return [np.unravel_index(i, shape) for i in flat]


def fd_grad(loss_fn, arr, indices, eps=1e-6):
    """Central differences of loss_fn() wrt arr at indices (arr is perturbed in place, restored)."""
    out = []
    for ix in indices:
        old = arr[ix]
        arr[ix] = old + eps
        lp = loss_fn()
        arr[ix] = old - eps
        lm = loss_fn()
        arr[ix] = old
        out.append((lp - lm) / (2 * eps))
    return np.array(out)


def check_module(module, x, *, n_samples=12, seed=0, tol=1e-6, backward_kwargs=None):
    """L = sum(y * R) (+ ctx['aux_loss'] when the module reports one): analytic input and parameter
    gradients vs central differences on sampled entries; returns {name: rel_err}."""
    rng = np.random.default_rng(seed)
    y, ctx = module.forward(x)
    R = rng.standard_normal(y.shape)

    def loss():
        yy, c = module.forward(x)
        aux = c.get("aux_loss", 0.0) if isinstance(c, dict) else 0.0
        return float((yy * R).sum()) + aux

    module.zero_grad()
    _, ctx = module.forward(x)
    dx = module.backward(R, ctx, **(backward_kwargs or {}))
    errs = {}
    ix = sample_indices(x.shape, n_samples, rng)
    errs["input"] = rel_err([dx[i] for i in ix], fd_grad(loss, x, ix))
    for name, p in module.named_parameters():
        ix = sample_indices(p.data.shape, n_samples, rng)
        errs[name] = rel_err([p.grad[i] for i in ix], fd_grad(loss, p.data, ix))
    bad = {k: v for k, v in errs.items() if not v < tol}
    assert not bad, f"finite-difference mismatch (rel err > {tol}): {bad}"
    return errs
