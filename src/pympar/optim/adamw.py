"""AdamW with decoupled weight decay over named parameters, via kernels.adamw_step."""
from __future__ import annotations


from .. import kernels
from ..backend import to_numpy, xp_of


def decays(name: str, data) -> bool:
    """Weight decay applies to matrices except embeddings: not to biases, LayerNorm, wte/wpe."""
    if data.ndim < 2:
        return False
    return not (name.endswith("wte.weight") or name.endswith("wpe.weight"))


class AdamW:
    def __init__(self, named_params, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                 decay_fn=decays):
        self.params = list(named_params)         # [(name, Parameter)]
        names = [n for n, _ in self.params]
        if len(set(names)) != len(names):
            raise ValueError("AdamW got the same parameter name twice")
        self.lr, self.beta1, self.beta2, self.eps, self.weight_decay = lr, betas[0], betas[1], eps, weight_decay
        self.decay = {n: bool(decay_fn(n, p.data)) for n, p in self.params}
        self.m = {n: xp_of(p.data).zeros_like(p.data) for n, p in self.params}   # on the params' device
        self.v = {n: xp_of(p.data).zeros_like(p.data) for n, p in self.params}
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
            self.m[n][...] = xp.asarray(to_numpy(d["m"][n]))
            self.v[n][...] = xp.asarray(to_numpy(d["v"][n]))
