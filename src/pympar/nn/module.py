"""The tiny module protocol: children and parameters found by attribute order (nanoGPT's
names), ``to(device)``, the split backward's default, and the parameter scope of whole models."""
from __future__ import annotations

import contextlib

from ..backend import to_device
from .parameter import Parameter
from .wgrad import WeightGrads


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
