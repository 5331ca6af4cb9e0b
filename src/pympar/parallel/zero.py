"""ZeRO: optimizer state (stage 1), gradients (2) and parameters (3) sharded over the dp group.

Sharding is per parameter along its first dimension (as FSDP2 and torchtitan do): of a local
tensor with n0 rows, rank r of a group of n keeps rows [r*part, min((r+1)*part, n0)) with
part = ceil(n0/n) (the last ranks may keep fewer rows, or none). The rows a rank keeps are a
Shard of the full tensor (``rows_shard``), so checkpoints store and reshard them like any
tensor-parallel shard, and the parameter's placement says which they are.

A bucket of parameters is laid out rank-major (``RowLayout``): segment r of a flat buffer of
n*S elements holds rank r's rows of every parameter of the bucket (each padded to ``part``
rows), so one reduce-scatter leaves every rank exactly its rows' gradient sum and one
allgather returns every rank's rows.

``ZeroAdamW`` keeps m and v only for the rows a rank keeps and updates the weights there in
place: the weights are the master copy (float32, or float64 in float64 runs), so nothing is
duplicated. Stages 1 and 2 then allgather the updated rows into every rank's full parameters;
stage 3 keeps only its rows (``ParamGather`` assembles a module's full parameters around its
forward and backward and frees them afterwards).

Memory per rank of float32 AdamW for P parameters (words): zero 0: 4P (params, grads, m, v);
zero 1: 2P + 2P/dp; zero 2: P + 3P/dp; zero 3: 4P/dp; plus transients of one bucket (the
send/receive buffers of a collective) and the modules gathered in flight.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np

from .. import kernels
from ..backend import xp_of
from ..optim.adamw import moments_like
from ..nn.parameter import NoGather  # noqa: F401  (the scope ParamGather replaces)


# --- the rank-major layout of a bucket ------------------------------------------------------------
class RowLayout:
    """Rank-major flat layout of the dim-0 row chunks of tensors of ``shapes`` over ``n`` ranks."""

    def __init__(self, shapes, n: int, rank: int):
        self.n, self.rank = int(n), int(rank)
        self.items = []                          # (shape, n0, row, part, off, lo, hi)
        off = 0
        for shape in shapes:
            shape = tuple(int(s) for s in shape) or (1,)
            n0, row = shape[0], int(math.prod(shape[1:]))
            part = -(-n0 // self.n)
            lo = min(self.rank * part, n0)
            hi = min(lo + part, n0)
            self.items.append((shape, n0, row, part, off, lo, hi))
            off += part * row
        self.seg = off                           # S: one rank's segment
        # one tensor whose rows divide evenly: the rank-major layout IS the tensor's own
        self.identity = len(self.items) == 1 and self.items[0][1] % self.n == 0

    def rows(self, i):
        """(lo, hi): rows of tensor i this rank keeps."""
        return self.items[i][5], self.items[i][6]

    def own(self, seg, i):
        """Tensor i's rows of this rank inside a segment (S,) (a view, shaped like the rows)."""
        shape, _, row, _, off, lo, hi = self.items[i]
        return seg[off:off + (hi - lo) * row].reshape((hi - lo,) + shape[1:])

    def _views(self, flat, i):
        shape, n0, row, part, off, _, _ = self.items[i]
        v = flat.reshape(self.n, self.seg)[:, off:off + part * row].reshape(self.n, part, row)
        return v, n0, row, part

    def pack(self, arrays, out):
        """Full tensors (None: zeros) -> ``out`` (n*S,), rank-major; padding rows are zero."""
        for i, a in enumerate(arrays):
            v, n0, row, part = self._views(out, i)
            if a is None:
                v[...] = 0
                continue
            a2 = a.reshape(n0, row)
            k = n0 // part                       # ranks with a whole chunk
            if k:
                v[:k] = a2[:k * part].reshape(k, part, row)
            rem = n0 - k * part
            if rem:
                v[k, :rem] = a2[k * part:]
                v[k, rem:] = 0
            start = k + (1 if rem else 0)               # ranks past the last row keep padding only
            if start < self.n:
                v[start:] = 0
        return out

    def unpack(self, flat, arrays):
        """``flat`` (n*S,), rank-major -> into the full tensors (every rank's rows)."""
        for i, a in enumerate(arrays):
            v, n0, row, part = self._views(flat, i)
            a2 = a.reshape(n0, row)
            k = n0 // part
            if k:
                a2[:k * part] = v[:k].reshape(k * part, row)
            rem = n0 - k * part
            if rem:
                a2[k * part:] = v[k, :rem]
        return arrays


def rows_shard(shard, full_shape, lo: int, hi: int):
    """The Shard of the full tensor that rows [lo, hi) of a local tensor hold; the local tensor is
    ``shard`` of the full one (None: the full tensor itself)."""
    from .shard import Shard

    full_shape = tuple(full_shape)
    if shard is None:
        return Shard(full_shape, (slice(lo, hi),))
    blocks = shard.blocks()
    out, pos = [], 0
    for a, b in blocks[0]:                       # the local rows walk the blocks of dim 0 in order
        s, e = max(lo, pos), min(hi, pos + b - a)
        if s < e:
            out.append(slice(a + s - pos, a + e - pos))
        pos += b - a
    if not out:
        out = [slice(0, 0)]
    first = out[0] if len(out) == 1 else tuple(out)
    return Shard(full_shape, (first,) + tuple(shard.index[1:]))


# --- the optimizer over kept rows -----------------------------------------------------------------
class ZeroAdamW:
    """AdamW over the rows this rank keeps of every parameter of DataParallel buckets.

    ``pieces``: per parameter (name, weight rows view, grad-rows getter, Shard of the rows,
    decays); the buckets own the storage. m and v have the shape of the kept rows."""

    def __init__(self, pieces, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, moments_dtype=None):
        self.lr, self.beta1, self.beta2, self.eps, self.weight_decay = lr, betas[0], betas[1], eps, weight_decay
        self.pieces = list(pieces)
        self.m, self.v = {}, {}
        for name, w, _, _, _ in self.pieces:            # (moments_like writes the zeros: resident at once)
            self.m[name] = moments_like(w, moments_dtype)
            self.v[name] = moments_like(w, moments_dtype)
        self.step_count = 0

    def step(self, lr=None):
        """One update of the kept rows from their reduced gradient (grads are left as they are)."""
        lr = self.lr if lr is None else lr
        self.step_count += 1
        for name, w, grad_of, _, dec in self.pieces:
            if w.size:
                kernels.adamw_step(w, grad_of(), self.m[name], self.v[name], lr=lr, beta1=self.beta1,
                                   beta2=self.beta2, eps=self.eps, weight_decay=self.weight_decay if dec else 0.0,
                                   step=self.step_count)

    def state_bytes(self) -> int:
        return int(sum(a.nbytes for a in self.m.values()) + sum(a.nbytes for a in self.v.values()))

    # checkpoints: the kept rows of m and v are pieces of the full moments (any layout reads them)
    def checkpoint_shards(self):
        shards = {}
        for name, w, _, sh, _ in self.pieces:
            if w.size:
                shards[f"m.{name}"] = (self.m[name], sh)
                shards[f"v.{name}"] = (self.v[name], sh)
        return shards, {"step": self.step_count}

    def load_checkpoint_shards(self, loaded, scalars):
        for key, arr in loaded.items():
            kind, name = key.split(".", 1)
            dst = (self.m if kind == "m" else self.v)[name]
            dst[...] = xp_of(dst).asarray(np.asarray(arr).astype(dst.dtype, copy=False))
        self.step_count = int(scalars.get("step", self.step_count))


# --- ZeRO-3: a module's full parameters around its use ------------------------------------------
class ParamGather:
    """Assembles the full (tp-local) parameters of a module from the dp group's rows for its
    forward or backward and frees them after; prefetches the next module's in the same order.

    units: the buckets (one per model piece and group) of every DataParallel with zero=3; a
    module's parameters may sit in several (the head uses the embedding's wte; a MoE block's
    experts are in the expert group's)."""

    enabled = True

    def __init__(self, syncs, order):
        self.unit_of = {}
        self.units = []
        for d in syncs:
            for b in d.buckets:
                self.units.append(b)
                for p in b.params:
                    self.unit_of[id(p)] = b
        self.order = order                         # modules in forward order
        self.pos = {id(m): i for i, m in enumerate(order)}
        self.gathered_bytes = self.peak_gathered_bytes = 0
        self.gathers = 0

    def _units_of(self, module):
        params = list(module.parameters())
        w = getattr(module, "wte", None)
        if w is not None and all(w is not q for q in params):
            params.append(w)
        out = []
        for p in params:
            u = self.unit_of.get(id(p))
            if u is not None and all(u is not x for x in out):
                out.append(u)
        return out

    def _start(self, u):
        if u.gather_req is None and not u.gathered:
            u.gather_req = u.dp.start_gather(u)
            self.gathers += 1

    def _ready(self, u):
        if not u.gathered:
            self._start(u)
            u.dp.finish_gather(u, u.gather_req)
            u.gather_req = None
            self.gathered_bytes += u.full_bytes
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def _release(self, u):
        if u.gathered and u.uses == 0 and u.gather_req is None:
            u.dp.release_params(u)
            self.gathered_bytes -= u.full_bytes

    def _neighbour(self, module, step):
        i = self.pos.get(id(module))
        j = None if i is None else i + step
        return self.order[j] if j is not None and 0 <= j < len(self.order) else None

    @contextlib.contextmanager
    def use(self, *modules, backward=False):
        """with gather.use(block): block's parameters are whole inside; the next module's (in
        forward order, or in backward order when ``backward``) are fetched meanwhile."""
        units = [u for m in modules for u in self._units_of(m)]
        for u in units:
            self._ready(u)
            u.uses += 1
        nxt = self._neighbour(modules[0], -1 if backward else 1)
        if nxt is not None:
            for u in self._units_of(nxt):
                self._start(u)
        try:
            yield
        finally:
            for u in units:
                u.uses -= 1
            for u in units:
                self._release(u)

    def settle(self):
        """Complete prefetches nobody used (the end of a pass) so no gather stays in flight."""
        for u in self.units:
            if u.gather_req is not None:
                u.dp.finish_gather(u, u.gather_req)
                u.gather_req = None
                self.gathered_bytes += u.full_bytes
            if u.uses == 0:
                self._release(u)


def install_gather(model, syncs):
    """ZeRO-3: a ParamGather over ``syncs``' buckets as the parameter scope of ``model`` (a GPT or
    TPGPT, or each chunk of a PipelineGPT), in the model's forward order; returns it."""
    holders = list(model.chunks) if hasattr(model, "chunks") else [model]
    gather = ParamGather(syncs, [m for h in holders for m in h.pieces()])
    for h in holders:
        h.param_gather = gather
    return gather
