"""Linear, LayerNorm, MLP and the token+position Embedding: forward and backward side by side.

Gradient convention: see pympar/nn/parameter.py (param grads +=, activation grads =).
"""
from __future__ import annotations

import numpy as np

from .. import kernels
from ..backend import xp_of
from .parameter import make_param
from .module import Module
from .products import compute_cast, compute_weight, linear_bf16, matmul
from .wgrad import accumulate, deferrable, deferring, product_grad, weight_grad

_param = make_param


class Linear(Module):
    """y = x @ W.T + b with W (out, in) like torch.nn.Linear."""

    def __init__(self, n_in, n_out, *, name, seed=0, dtype=np.float32, bias=True, std=0.02,
                 compute_dtype=None):
        self.weight = _param(seed, f"{name}.weight", (n_out, n_in), dtype, std)
        self.bias = _param(seed, f"{name}.bias", (n_out,), dtype) if bias else None
        self._cdt = compute_dtype

    def forward(self, x, out=None, add_bias=True):   # x (..., in) -> y (..., out)
        """out (optional): a C-contiguous (N, out) array (a block of rows of a larger one) to write y into.
        add_bias=False: x @ W.T only, for a caller that adds the bias in its next pass (bias_value)."""
        w = compute_weight(self.weight, self._cdt)
        x2 = x.reshape(-1, x.shape[-1])
        bias = self.bias is not None and add_bias
        y = linear_bf16(x2, w.T, out, self.bias_value() if bias else None) if self._cdt is not None else None
        if y is None:                            # (the bf16 GEMM adds the bias in its epilogue)
            y = matmul(x2, w.T, out=out)         # one GEMM over all tokens: (N, out)
            if bias:
                kernels.bias_add(y, self.bias_value())
        return y.reshape(*x.shape[:-1], y.shape[-1]), x

    def forward_gelu(self, x, out=None):        # x (..., in) -> h (..., out) = x W^T + b, GELU(h)
        """h and GELU(h) at once (the MLP's c_fc): the bias add and the GELU in the bf16 GEMM's
        epilogue where it runs, else one elementwise pass after the GEMM (kernels.bias_gelu_forward).
        out (optional): a C-contiguous (N, out) array to write h into."""
        if self._cdt is not None and self.bias is not None:
            x2 = x.reshape(-1, x.shape[-1])
            xp = xp_of(x2)
            h = out if out is not None else xp.empty((x2.shape[0], self.weight.shape[0]), x2.dtype)
            g = xp.empty(h.shape, h.dtype)
            if linear_bf16(x2, compute_weight(self.weight, self._cdt).T, h, self.bias_value(), g) is not None:
                shape = (*x.shape[:-1], h.shape[-1])
                return h.reshape(shape), g.reshape(shape)
        if self.bias is None:
            h, _ = self.forward(x, out=out)
            return h, kernels.gelu_forward(h)
        h, _ = self.forward(x, out=out, add_bias=False)
        return h, kernels.bias_gelu_forward(h, self.bias_value())

    def bias_value(self):
        """The bias as forward adds it: the float32 master itself to bf16 activations on NumPy (the
        kernels add it in float32 and round once), else in the compute dtype."""
        b = self.bias.data
        if self._cdt is not None and type(b) is np.ndarray and b.dtype == np.float32:
            return b
        return compute_cast(b, self._cdt)

    def backward(self, dy, x, out=None):         # dy (..., out) -> dx (..., in)
        """out (optional): an array of dx's shape and dtype to write dx into (it may be x itself
        when nothing defers the weight gradient: dW is computed before dx is written)."""
        dy2 = dy.reshape(-1, dy.shape[-1])       # (N, out)
        x2 = x.reshape(-1, x.shape[-1])          # (N, in)
        w, b = self.weight, self.bias            # W pass (deferrable): dW = dy^T x, db = sum dy
        product_grad(w, dy2.T, x2)                                         # (out, in)
        if b is not None:
            weight_grad(b, lambda: kernels.column_sum(dy2, b.dtype),
                        into=lambda o: kernels.column_sum(dy2, o.dtype, out=o))
        o = None if out is None else out.reshape(dy2.shape[0], -1)
        dx = matmul(dy2, compute_weight(w, self._cdt), out=o)   # (N, in): the B pass
        return dx.reshape(*dy.shape[:-1], dx.shape[-1])


class LayerNorm(Module):
    def __init__(self, n, *, name, dtype=np.float32, bias=True, eps=1e-5, compute_dtype=None):
        self.weight = _param(0, f"{name}.weight", (n,), dtype)
        self.bias = _param(0, f"{name}.bias", (n,), dtype) if bias else None
        self.eps = eps
        self._cdt = compute_dtype

    def _b(self):
        if self.bias is None:
            return xp_of(self.weight.data).zeros_like(self.weight.data)
        return self.bias.data

    def forward(self, x):                        # x (..., C) -> y (..., C)
        y, mean, rstd = kernels.layernorm_forward(x, self.weight.data, self._b(), self.eps)
        return y, (x, mean, rstd)

    def output(self, ctx):
        """forward's output again from its ctx (bitwise: the same kernel on the same x and
        parameters), for a caller that did not keep it."""
        x = ctx[0]
        return kernels.layernorm_forward(x, self.weight.data, self._b(), self.eps)[0]

    def forward_add(self, x, res):
        """x += res (the residual sum, in place: x is then the sum, which the caller keeps), and
        forward of it, in one pass (kernels.add_layernorm_forward): bitwise the add and forward."""
        y, mean, rstd = kernels.add_layernorm_forward(x, res, self.weight.data, self._b(), self.eps)
        return y, (x, mean, rstd)

    def backward(self, dy, ctx, residual=None):  # dy (..., C) -> dx (..., C)
        """residual (optional): a gradient to add to dx (the residual path's), in the same pass."""
        x, mean, rstd = ctx
        dx, dw, db = kernels.layernorm_backward(dy, x, self.weight.data, mean, rstd, residual)
        accumulate(self.weight, dw)
        if self.bias is not None:
            accumulate(self.bias, db)
        return dx


class MLP(Module):
    """c_fc (C -> 4C), GELU (tanh form), c_proj (4C -> C), over at most ``MLP_ROWS`` tokens at a time.

    Every token's MLP is its own, so forward and backward run in blocks of MLP_ROWS rows (one block
    when there are fewer): no (tokens, 4C) array but the kept hidden layer exists whole. The ctx
    keeps x and the GELU's input h; backward computes the GELU output again (one elementwise pass,
    the same numbers bit for bit). ``keep_hidden = False`` (set by nn.gpt.set_recompute for
    'selective' and 'full'): h is not kept either, and backward computes each block's h again
    (one more c_fc GEMM) -- bitwise the same numbers, 4C per token and layer less to hold. Backward's
    transient is then a block's h and its GELU output (the gradient written over the latter),
    unless a zero-bubble schedule defers the weight gradients, which then keep every block's GELU
    output and hidden gradient until the W pass. The blocks are the same in every mode, so the
    recomputation modes and the deferred W give the gradients of 'none' bit for bit.
    Tensor-parallel subclasses (whose layers communicate) set ``rowwise = False``: one block,
    h always kept."""

    rowwise = True                               # the layers are local: any rows may run alone
    keep_hidden = True

    def __init__(self, n_embd, *, name, seed=0, dtype=np.float32, bias=True, n_layer=1,
                 compute_dtype=None):
        self.c_fc = Linear(n_embd, 4 * n_embd, name=f"{name}.c_fc", seed=seed, dtype=dtype,
                           bias=bias, compute_dtype=compute_dtype)
        self.c_proj = Linear(4 * n_embd, n_embd, name=f"{name}.c_proj", seed=seed, dtype=dtype,
                             bias=bias, std=0.02 / (2 * n_layer) ** 0.5, compute_dtype=compute_dtype)

    def weights_and_biases(self):
        """(c_fc.weight, c_fc.bias, c_proj.weight, c_proj.bias), a bias None where there is none: the
        order the grouped expert call (nn/moe.py, csrc/grouped.cpp) and the replicas exchange them."""
        return self.c_fc.weight, self.c_fc.bias, self.c_proj.weight, self.c_proj.bias

    def empty_like(self, name):
        """An MLP of this one's shapes, dtypes, bias and compute dtype whose values the caller writes
        (a replicated expert: parallel/ep.py); made on first use like any parameter's."""
        return MLP(self.c_fc.weight.shape[1], name=name, dtype=self.c_fc.weight.dtype,
                   bias=self.c_fc.bias is not None, compute_dtype=self.c_fc._cdt)

    def block_rows(self, N: int) -> int:
        """Rows per block: all N for a tensor-parallel MLP or when N <= MLP_ROWS."""
        return N if not self.rowwise else min(N, MLP_ROWS)

    def _hidden(self, x, out=None):
        """c_fc's output h (its bias added) and GELU(h): the bias add and the GELU in one pass
        (kernels.bias_gelu_forward) where c_fc is a plain Linear with a bias."""
        fc = self.c_fc
        if type(fc) is Linear:
            return fc.forward_gelu(x, out)
        h, _ = fc.forward(x) if out is None else fc.forward(x, out=out)
        return h, kernels.gelu_forward(h)

    def forward(self, x, consume=False):         # x (..., C) -> y (..., C)
        """consume=True: the caller owns x and will not read it again (a block's ln_2 output, which
        backward computes again), so y is written over x block by block, each block's rows once
        c_fc has read them; the ctx then has no input (None in its place)."""
        x2 = x.reshape(-1, x.shape[-1])
        N = x2.shape[0]
        rows = self.block_rows(N)
        keep_x = None if consume else x
        if rows >= N:
            h, g = self._hidden(x)               # h, g (..., 4C); g is not kept
            over = self._over(consume, x2, g.dtype)
            y, _ = self.c_proj.forward(g, out=x2) if over else self.c_proj.forward(g)   # (a TP layer takes no out)
            return y.reshape(*x.shape[:-1], y.shape[-1]), (keep_x, h if self.keep_hidden else None)
        xp = xp_of(x2)
        w = self.c_fc.weight.data
        h = xp.empty((N, w.shape[0]), dtype=x2.dtype) if self.keep_hidden else None
        y = None
        for r0 in range(0, N, rows):
            r1 = min(r0 + rows, N)
            hb, g = self._hidden(x2[r0:r1], out=None if h is None else h[r0:r1])
            if y is None:
                over = self._over(consume, x2, g.dtype)
                y = x2 if over else xp.empty((N, self.c_proj.weight.data.shape[0]), dtype=g.dtype)
            self.c_proj.forward(g, out=y[r0:r1])
            del hb, g                            # before the next block's: one block's pair at a time
        return y.reshape(*x.shape[:-1], y.shape[-1]), (keep_x, h)

    def backward(self, dy, ctx, consume=False):
        """consume=True: the caller owns ctx's input x and will not read it again (a block's ln_2
        output, computed again for this backward), so each block's dx is written over its rows of
        x once their weight gradients are taken -- unless those wait for a W pass, which reads x."""
        x, h = ctx
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        N = x2.shape[0]
        rows = self.block_rows(N)
        over = self._over(consume and not deferring(), x2, dy2.dtype)
        if rows >= N:
            return self._backward_rows(dy, x, h, out=x2 if over else None).reshape(x.shape)
        dx = x2 if over else None
        for r0 in range(0, N, rows):
            r1 = min(r0 + rows, N)
            dxc = self._backward_rows(dy2[r0:r1], x2[r0:r1], None if h is None else h[r0:r1],
                                      out=None if dx is None else dx[r0:r1])
            if dx is None:
                dx = xp_of(dxc).empty((N, dxc.shape[-1]), dtype=dxc.dtype)
                dx[r0:r1] = dxc
        return dx.reshape(x.shape)

    def _over(self, consume, x2, dtype) -> bool:
        """Whether a result of ``dtype`` may be written over the input rows x2 (consume: the caller
        lets them go): a local (row-wise) MLP, a C-contiguous x2 of that dtype."""
        return consume and self.rowwise and x2.flags.c_contiguous and x2.dtype == dtype

    def _backward_rows(self, dy, x, h, out=None):
        """One block's backward (h None: computed again from x, as forward computed it)."""
        if h is None:
            h, g = self._hidden(x)               # h, and the GELU output c_proj's dW needs
        else:
            g = kernels.gelu_forward(h)          # again: c_proj's weight gradient needs it
        dg = self.c_proj.backward(dy, g, out=None if deferring() else g)   # (..., 4C)
        del g
        dh = kernels.gelu_backward(h, dg, out=dg)
        return self.c_fc.backward(dh, x) if out is None else self.c_fc.backward(dh, x, out=out)


# tokens per MLP block (forward and backward): a GEMM of 1024 rows runs near the BLAS's full
# rate at any width, and the (tokens, 4C) transients stay at 1024 rows however long the sequence
MLP_ROWS = 1024


class TokenEmbedding(Module):
    """What a token + position embedding declares (this module's Embedding and the
    vocabulary-parallel one): ``wte``, ``wpe``, and ``positions``, the global positions of the T
    tokens given (context parallelism: parallel.cp sets this rank's); None: 0 .. T-1. ZeRO-3
    gathers wte and wpe as units of their own (the head's use of wte comes alone)."""
    positions = None


class Embedding(TokenEmbedding):
    """Token + learned position embeddings: idx (B, T) int -> x (B, T, C)."""

    def __init__(self, vocab_size, block_size, n_embd, *, seed=0, dtype=np.float32,
                 compute_dtype=None, prefix="transformer"):
        self.wte = _param(seed, f"{prefix}.wte.weight", (vocab_size, n_embd), dtype)
        self.wpe = _param(seed, f"{prefix}.wpe.weight", (block_size, n_embd), dtype)
        self._cdt = compute_dtype

    def _named_parameters(self, prefix):         # nanoGPT names: transformer.wte.weight, ...
        pre = f"{prefix}." if prefix else ""
        yield f"{pre}wte.weight", self.wte
        yield f"{pre}wpe.weight", self.wpe

    def forward(self, idx):                      # idx (B, T) -> x (B, T, C)
        B, T = idx.shape
        if T > self.wpe.data.shape[0]:
            raise ValueError(f"sequence length T={T} exceeds block_size={self.wpe.data.shape[0]}")
        x = self.wte.data[idx] + self.wpe.data[position_rows(self, T)]
        return compute_cast(x, self._cdt), idx

    def backward(self, dx, idx):                 # dx (B, T, C) -> None (idx has no gradient)
        B, T = idx.shape
        C = dx.shape[-1]
        dxf = dx.astype(self.wte.grad.dtype, copy=False)
        wte, wpe, rows = self.wte, self.wpe, position_rows(self, T)

        def grads():                             # weight gradients only: deferrable as a whole
            kernels.scatter_add(wte.grad, idx.reshape(-1), dxf.reshape(-1, C))
            wpe.grad[rows] += kernels.column_sum(dxf.reshape(B, -1)).reshape(T, C)   # distinct rows

        deferrable(grads)
        return None


def position_rows(emb, T, part=None):
    """Rows of wpe for T tokens: 0..T-1, or emb.positions (on wpe's device) when set; ``part``
    (a slice) takes a part of them (sequence parallelism's rows)."""
    pos = getattr(emb, "positions", None)
    if pos is None:
        return part if part is not None else slice(0, T)
    if len(pos) != T:
        raise ValueError(f"{T} tokens per sequence, but this rank holds {len(pos)} positions of each "
                         f"(context parallelism: pass the rank's part of every sequence)")
    cached = getattr(emb, "_pos_dev", None)
    if cached is None or cached[0] is not pos:
        emb._pos_dev = cached = (pos, xp_of(emb.wpe.data).asarray(pos))
    return cached[1] if part is None else cached[1][part]
