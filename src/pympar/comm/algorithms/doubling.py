"""Recursive doubling (small messages) and Rabenseifner (medium), for any rank count.

Non-powers of two fold first: with p = 2^floor(log2 n) and rem = n - p, each even rank
r < 2*rem hands its data to r+1 and sits out; the p remaining ranks get virtual ranks
v (odd r < 2*rem -> r//2, others -> r - rem), run the power-of-two algorithm, and the
folded ranks receive the result at the end.
"""
from __future__ import annotations

from .p2p import bounds, power_of_two_floor


class _Fold:
    def __init__(self, n, r):
        self.n, self.r = n, r
        self.p = power_of_two_floor(n)
        self.rem = n - self.p
        if r < 2 * self.rem:
            self.v = -1 if r % 2 == 0 else r // 2
        else:
            self.v = r - self.rem

    def real(self, v):
        return 2 * v + 1 if v < self.rem else v + self.rem

    def vbounds(self, E):
        """Element offsets owned by each virtual rank when real rank i owns E[i]:E[i+1]."""
        return [E[2 * v] if v <= self.rem else E[v + self.rem] for v in range(self.p + 1)]


def _fold_in_reduce(ctx, buf, f):
    r = ctx.rank
    if r < 2 * f.rem:
        if f.v < 0:
            ctx.send(buf, r + 1)
        else:
            tmp = ctx.empty(buf.size, buf)
            ctx.recv(tmp, r - 1)
            ctx.reduce(buf, tmp)


def _fold_out(ctx, buf, f):
    r = ctx.rank
    if r < 2 * f.rem:
        if f.v < 0:
            ctx.recv(buf, r + 1)
        else:
            ctx.send(buf, r - 1)


def recursive_doubling_allreduce(ctx, buf):
    """buf (count,) reduced in place: log2(p) full-buffer exchanges (+2 when n is not 2^k)."""
    f = _Fold(ctx.size, ctx.rank)
    if ctx.size == 1:
        return
    _fold_in_reduce(ctx, buf, f)
    if f.v >= 0:
        tmp = ctx.empty(buf.size, buf)
        mask = 1
        while mask < f.p:
            ctx.sendrecv(buf, f.real(f.v ^ mask), tmp, f.real(f.v ^ mask))
            ctx.reduce(buf, tmp)
            mask <<= 1
    _fold_out(ctx, buf, f)


def _halving(ctx, buf, f, VE):
    """Recursive halving among virtual ranks: v ends with VE[v]:VE[v+1] reduced."""
    v, lo, hi = f.v, 0, f.p
    tmp = ctx.empty(max(VE[i + 1] - VE[i] for i in range(f.p)) * max(1, f.p // 2), buf)
    mask = f.p // 2
    while mask >= 1:
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if v & mask == 0 else ((mid, hi), (lo, mid))
        k0, k1 = VE[keep[0]], VE[keep[1]]
        peer = f.real(v ^ mask)
        ctx.sendrecv(buf[VE[give[0]]:VE[give[1]]], peer, tmp[:k1 - k0], peer)
        ctx.reduce(buf[k0:k1], tmp[:k1 - k0])
        lo, hi = keep
        mask >>= 1


def _doubling_gather(ctx, buf, f, VE):
    """Recursive doubling allgather among virtual ranks: v starts with VE[v]:VE[v+1]."""
    v, mask = f.v, 1
    while mask < f.p:
        mine = (v // mask) * mask
        theirs = ((v ^ mask) // mask) * mask
        peer = f.real(v ^ mask)
        ctx.sendrecv(buf[VE[mine]:VE[mine + mask]], peer, buf[VE[theirs]:VE[theirs + mask]], peer)
        mask <<= 1


def rabenseifner_allreduce(ctx, buf):
    """Recursive-halving reduce-scatter then recursive-doubling allgather over p blocks."""
    f = _Fold(ctx.size, ctx.rank)
    if ctx.size == 1:
        return
    _fold_in_reduce(ctx, buf, f)
    if f.v >= 0:
        VE = bounds(buf.size, f.p)
        _halving(ctx, buf, f, VE)
        _doubling_gather(ctx, buf, f, VE)
    _fold_out(ctx, buf, f)


def halving_reduce_scatter(ctx, buf, E):
    """buf (count,) reduced so that rank r ends with buf[E[r]:E[r+1]] (buf is scratch)."""
    f = _Fold(ctx.size, ctx.rank)
    if ctx.size == 1:
        return
    r = ctx.rank
    _fold_in_reduce(ctx, buf, f)
    if f.v >= 0:
        _halving(ctx, buf, f, f.vbounds(E))
    if r < 2 * f.rem:  # odd r holds blocks r-1 and r; hand r-1 its block
        if f.v < 0:
            ctx.recv(buf[E[r]:E[r + 1]], r + 1)
        else:
            ctx.send(buf[E[r - 1]:E[r]], r - 1)


def doubling_allgather(ctx, buf, E):
    """buf (count,) with rank r's block at E[r]:E[r+1]; afterwards all blocks everywhere."""
    f = _Fold(ctx.size, ctx.rank)
    if ctx.size == 1:
        return
    r = ctx.rank
    if r < 2 * f.rem:
        if f.v < 0:
            ctx.send(buf[E[r]:E[r + 1]], r + 1)
        else:
            ctx.recv(buf[E[r - 1]:E[r]], r - 1)
    if f.v >= 0:
        _doubling_gather(ctx, buf, f, f.vbounds(E))
    _fold_out(ctx, buf, f)
