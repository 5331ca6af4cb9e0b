"""AdamW with decoupled weight decay over named parameters, via kernels.adamw_step."""
from __future__ import annotations


import numpy as np

from .. import kernels
from ..backend import dtype as backend_dtype
from ..backend import is_bfloat16, to_numpy, xp_of


def decays(name: str, data) -> bool:
    """Weight decay applies to matrices except embeddings: not to biases, LayerNorm, wte/wpe."""
    if data.ndim < 2:
        return False
    return not (name.endswith("wte.weight") or name.endswith("wpe.weight"))


def moments_like(data, moments_dtype=None):
    """Zero moments for a parameter: its own dtype, or ``moments_dtype`` ('bfloat16': bf16 optimizer
    state beside float32 master weights, half the bytes; the update still runs in float32)."""
    xp = xp_of(data)
    dt = data.dtype if moments_dtype in (None, "float32", data.dtype) else backend_dtype(moments_dtype)
    if dt != data.dtype and not (data.dtype == np.float32 and is_bfloat16(dt)):
        raise ValueError(f"moments_dtype={moments_dtype!r}: bf16 moments go with float32 master weights, "
                         f"not {data.dtype}")
    a = xp.empty(data.shape, dtype=dt)
    a.fill(0)
    return a


class AdamW:
    def __init__(self, named_params, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                 decay_fn=decays, moments_dtype=None):
        self.params = list(named_params)         # [(name, Parameter)]
        names = [n for n, _ in self.params]
        if len(set(names)) != len(names):
            raise ValueError("AdamW got the same parameter name twice")
        self.lr, self.beta1, self.beta2, self.eps, self.weight_decay = lr, betas[0], betas[1], eps, weight_decay
        self.decay = {n: bool(decay_fn(n, p.data)) for n, p in self.params}
        self.m = {n: moments_like(p.data, moments_dtype) for n, p in self.params}   # on the params' device
        self.v = {n: moments_like(p.data, moments_dtype) for n, p in self.params}
        self.step_count = 0

    def step(self, lr=None):
        """One update from the current .grad of every parameter (grads are left as they are)."""
        lr = self.lr if lr is None else lr
        self.step_count += 1
        for n, p in self.params:
            kernels.adamw_step(p.data, p.grad, self.m[n], self.v[n], lr=lr, beta1=self.beta1,
                               beta2=self.beta2, eps=self.eps,
                               weight_decay=self.weight_decay if self.decay[n] else 0.0,
                               step=self.step_count)

    def state_dict(self):
        return dict(step=self.step_count, m={n: a.copy() for n, a in self.m.items()},
                    v={n: a.copy() for n, a in self.v.items()})

    def state_views(self):
        """state_dict's layout without the copies (a checkpoint reads them at once, or copies
        them itself when it writes in the background)."""
        return dict(step=self.step_count, m=dict(self.m), v=dict(self.v))

    def load_state_dict(self, d):
        if set(d["m"]) != set(self.m):
            raise ValueError(f"optimizer state names differ: missing {sorted(set(self.m) - set(d['m']))[:5]}, "
                             f"unexpected {sorted(set(d['m']) - set(self.m))[:5]}")
        self.step_count = int(d["step"])
        for n in self.m:
            xp = xp_of(self.m[n])
            self.m[n][...] = xp.asarray(to_numpy(d["m"][n]).astype(self.m[n].dtype, copy=False))
            self.v[n][...] = xp.asarray(to_numpy(d["v"][n]).astype(self.v[n].dtype, copy=False))
