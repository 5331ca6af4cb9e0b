"""Dynamic loss scaling for float16 training."""
from __future__ import annotations

from ..backend import xp_of


class DynamicLossScaler:
    """Multiply the loss by .scale; on inf/nan grads skip the step and halve the scale;
    after growth_interval good steps in a row double it."""

    def __init__(self, init_scale=2.0 ** 16, growth_interval=1000, backoff=0.5, growth=2.0,
                 min_scale=1.0):
        self.scale = float(init_scale)
        self.growth_interval, self.backoff, self.growth, self.min_scale = growth_interval, backoff, growth, min_scale
        self.good_steps = 0

    @staticmethod
    def found_inf(params) -> bool:
        """Whether any local gradient holds inf or nan (reduce with MAX over ranks when sharded)."""
        params = list(params)
        if not params:
            return False
        xp = xp_of(params[0].grad)
        flags = [xp.isfinite(p.grad).all() for p in params]
        return not bool(xp.stack(flags).all())       # one host sync on a GPU

    def update(self, found_inf: bool) -> bool:
        """Advance after a backward pass; returns True when the optimiser step must be skipped."""
        if found_inf:
            self.scale = max(self.min_scale, self.scale * self.backoff)
            self.good_steps = 0
            return True
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth
            self.good_steps = 0
        return False

    def state_dict(self):
        return dict(scale=self.scale, good_steps=self.good_steps)

    def load_state_dict(self, d):
        self.scale, self.good_steps = float(d["scale"]), int(d["good_steps"])
