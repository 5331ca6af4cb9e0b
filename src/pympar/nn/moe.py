"""Mixture-of-Experts layer: router -> top-k -> capacity -> permute -> experts -> combine.

Routing, for N = B*T tokens of one micro-batch and E experts:
  logits = x @ Wr.T (float32, float64 for float64 models); probs = softmax(logits)
  selection uses probs + expert_bias (aux-loss-free balancing; the bias never enters gates)
  gates = chosen probs, renormalised to sum 1 when top_k > 1, raw when top_k = 1
  capacity = ceil(top_k * N * capacity_factor / E) slots per expert (capacity_factor 0: dropless)
Priority when an expert overflows: CHOICE-MAJOR. All first choices (in token order) are
placed before any second choice (in token order), and so on. A dropped assignment adds
nothing; the block's residual carries the token.
Under context parallelism (parallel.cp) a rank holds some positions of every sequence: the
counts behind f and the capacity's drops are those of the whole micro-batch (``cp_routing``),
the means over tokens are over the rank's own, and the cp group's mean of its ranks' losses is
the micro-batch's.
Loss terms (per micro-batch), both added to the model loss:
  aux = aux_coef * E * sum_i f_i * P_i,  f_i = assignments routed to i BEFORE dropping / (N k),
        P_i = mean over tokens of probs[:, i]  (f is a count: no gradient through it)
  z   = z_coef * mean over tokens of logsumexp(logits)^2
Gradient convention: see pympar/nn/parameter.py. ``backward(dy, ctx, daux)`` takes daux =
d(total loss)/d(aux + z) (the caller's grad_scale).
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from .. import kernels
from ..backend import to_device, xp_of
from ..kernels.blas import over_chunks
from ..kernels import gemm
from ..kernels.blas import _C
from . import layers
from .layers import MLP
from .parameter import make_param
from .module import Module
from .products import compute_weight
from .wgrad import deferrable, deferring, weight_grad


def _stable_argsort(a):
    """argsort keeping equal keys in index order (CuPy's sort is always stable; an older
    CuPy that refuses the ``kind`` argument gets the plain call)."""
    xp = xp_of(a)
    try:
        return xp.argsort(a, kind="stable")
    except (TypeError, ValueError, NotImplementedError):
        return xp.argsort(a)


class MoE(Module):
    def __init__(self, n_embd, n_expert, *, name, top_k=2, capacity_factor=0.0, aux_coef=0.01,
                 z_coef=0.001, shared_expert=False, bias_update_rate=0.0, seed=0,
                 dtype=np.float32, bias=True, n_layer=1, compute_dtype=None):
        if not 1 <= top_k <= n_expert:
            raise ValueError(f"top_k={top_k} must be in 1..n_expert={n_expert}")
        self.n_expert, self.top_k = n_expert, top_k
        self.capacity_factor, self.aux_coef, self.z_coef = capacity_factor, aux_coef, z_coef
        self.bias_update_rate = bias_update_rate
        self._acc = np.float64 if np.dtype(dtype) == np.float64 else np.float32
        self.router = Module()
        self.router.weight = make_param(seed, f"{name}.router.weight", (n_expert, n_embd), dtype)
        mk = dict(seed=seed, dtype=dtype, bias=bias, n_layer=n_layer, compute_dtype=compute_dtype)
        self.experts = [MLP(n_embd, name=f"{name}.experts.{e}", **mk) for e in range(n_expert)]
        self.shared = MLP(n_embd, name=f"{name}.shared", **mk) if shared_expert else None
        self.expert_bias = np.zeros(n_expert, dtype=self._acc)  # selection only, not trained
        self.recording = True            # count loads (False for evaluation passes)
        self.cp_routing = None           # parallel.cp.CPRouting when the micro-batch spans a cp group
        # expert parallelism (parallel.ep.install_expert_parallel): this rank keeps experts
        # [expert_lo, expert_lo + len(experts)) and expert_parallel (a parallel.ep.ExpertParallel)
        # moves the kept rows to their experts' ranks and back
        self.expert_lo = 0
        self.expert_parallel = None
        self._reset_counters()

    def _reset_counters(self):
        """Loads counted on the device of expert_bias (no host sync per micro-batch)."""
        xp = xp_of(self.expert_bias)
        self._stats = xp.zeros(self.n_expert, np.int64), 0, 0   # (load, dropped, assignments)
        self._load_since_update = xp.zeros(self.n_expert, np.int64)

    def move_buffers(self, device):
        self.expert_bias = to_device(self.expert_bias, device)
        self._reset_counters()

    def capacity(self, n_tokens: int) -> int:
        """Slots per expert for a micro-batch of n_tokens; 0 = unlimited."""
        if self.capacity_factor <= 0:
            return 0
        return math.ceil(self.top_k * n_tokens * self.capacity_factor / self.n_expert)

    # --- experts: the seam expert parallelism replaces ---------------------------------------
    # Local experts run as one grouped call (csrc/grouped.cpp: every expert's MLP over its rows,
    # the products MLP makes, spread over the kernel threads) where it applies: NumPy float32 or
    # float64 experts that are plain MLPs (bf16 compute on pympar's AMX or AVX512-BF16 kernel), MKL
    # selected, the C++ module built. Else (and with ``grouped = False``) one MLP call per expert, side
    # by side over the threads. Under a zero-bubble split (nn.wgrad.deferring) the grouped B pass makes the input
    # gradient and keeps each row's GELU output and hidden gradient, and the W pass makes the weight
    # gradients from them, as MLP does.
    grouped = True

    def _grouped_fn(self, xs, experts):
        """How the grouped call runs here: the cblas_?gemm address (float32/float64), "amx" or
        "avx512bf16" (bf16 experts on pympar's kernel: AMX tiles or AVX512-BF16 dot products), or
        None (the per-expert loop)."""
        if not (self.grouped and _C is not None and type(xs) is np.ndarray and xs.ndim == 2
                and xs.flags.c_contiguous and kernels.backend(xs) != "reference"):
            return None
        e = experts[0] if experts else None
        if e is None or type(e) is not MLP:
            return None
        if len(experts) == 1 and kernels.get_num_threads() > 1:
            return None                                  # one expert: the loop splits its products over the threads
        cdt = e.c_fc._cdt
        if cdt is None and xs.dtype in (np.float32, np.float64) and e.c_fc.weight.data.dtype == xs.dtype:
            return gemm.gemm_address(xs.dtype)
        engine = gemm.bf16_engine()
        if (cdt is not None and xs.dtype == cdt and cdt.name == "bfloat16" and e.c_fc.weight.data.dtype == np.float32
                and engine in gemm.OWN_BF16 and hasattr(_C, "grouped_mlp_forward_bf16")):
            return engine
        return None

    @staticmethod
    def _addresses_bf16(experts, grads=False, weights=True):
        """Each expert's 12 addresses for the bf16 grouped call (csrc/grouped.cpp, SLOTS): the bf16
        compute copies of its weights, their AMX packs where registered (kernels/gemm.py), the float32
        biases and (backward) the gradients; and the arrays, kept alive for the call. weights=False:
        zeros in the weights' slots (a W pass reads none)."""
        rows, keep, fresh = [], [], []
        if grads:
            for m in experts:                            # checked before _grads_of marks any gradient written
                for p in m.weights_and_biases():
                    if p is not None and p.dtype != np.float32:
                        raise ValueError(f"{p.name}: the grouped bf16 call needs float32 master weights")
            gs, fresh = MoE._grads_of(experts)
            keep += [g for g in gs if g is not None]
        for k, m in enumerate(experts):
            row = []
            for lin in (m.c_fc, m.c_proj) if weights else ():
                w = compute_weight(lin.weight, lin._cdt)
                pt, pn = gemm.bf16_pack(w.T), gemm.bf16_pack(w)
                b = None if lin.bias is None else lin.bias_value()
                keep += [w, pt, pn, b]
                row += [w.ctypes.data, 0 if pt is None else pt.ctypes.data, 0 if pn is None else pn.ctypes.data,
                        0 if b is None else b.ctypes.data]
            if not weights:
                row += [0] * 8
            if grads:
                row += [0 if g is None else g.ctypes.data for g in gs[4 * k:4 * k + 4]]
            else:
                row += [0, 0, 0, 0]
            rows.append(row)
        return np.array(rows, np.int64).reshape(-1, 12), keep, np.array(fresh, bool)  # host

    @staticmethod
    def _params_of(experts):
        return [None if p is None else p.data for m in experts for p in m.weights_and_biases()]

    def _run_grouped(self, fn, xs, n, experts):
        used = [j for j, c in enumerate(n) if c]
        ex = [experts[j] for j in used]
        keep = all(m.keep_hidden for m in ex)
        counts = np.array([n[j] for j in used], np.int64)  # host
        ys = np.empty_like(xs)
        h = np.empty((xs.shape[0], ex[0].c_fc.weight.data.shape[0]), xs.dtype) if keep and ex else None
        if ex and fn in gemm.OWN_BF16:
            addrs, keep, _ = self._addresses_bf16(ex)
            _C.grouped_mlp_forward_bf16(xs, counts, addrs, ex[0].c_fc.weight.data.shape[0], h, ys,
                                        layers.MLP_ROWS, fn == "amx")
            del keep
        elif ex:
            _C.grouped_mlp_forward(fn, xs, counts, self._params_of(ex), h, ys, layers.MLP_ROWS)
        return ys, ("grouped", ex, counts, xs, h)

    def _run_grouped_backward(self, fn, dys, ctx):
        _, ex, counts, xs, h = ctx
        dxs = np.empty_like(dys)
        if not ex:
            return dxs
        dys = np.ascontiguousarray(dys)
        H = ex[0].c_fc.weight.data.shape[0]              # (gathered here under ZeRO-3, maybe not in the W pass)
        if deferring():                                  # B now (keeping g and dh), W when it is asked for
            g_keep, dh_keep = np.empty((xs.shape[0], H), xs.dtype), np.empty((xs.shape[0], H), xs.dtype)
            self._grouped_backward_call(fn, ex, counts, xs, dys, h, dxs, False, (g_keep, dh_keep))
            deferrable(lambda: self._grouped_backward_call(fn, ex, counts, xs, dys, None, None, True, (g_keep, dh_keep)))
            return dxs
        self._grouped_backward_call(fn, ex, counts, xs, dys, h, dxs, True, (None, None))
        return dxs

    @staticmethod
    def _grads_of(ex):
        """The experts' gradient buffers for a grouped backward (4 per expert, None for no bias) and
        whether each is written fresh (the step's first contribution) or added to."""
        grads, fresh = [], []
        for m in ex:
            for p in m.weights_and_biases():
                if p is None:
                    grads.append(None)
                    fresh.append(False)
                    continue
                dst = p.write_grad()
                grads.append(p.grad if dst is None else dst)
                fresh.append(dst is not None)
        return grads, np.array(fresh, bool)  # host

    def _grouped_backward_call(self, fn, ex, counts, xs, dys, h, dxs, grads, keeps):
        """csrc/grouped.cpp's backward: everything (grads, no keeps), the input gradient keeping g and
        dh (keeps, no grads), or the weight gradients from them (grads and keeps, dxs None: a W pass,
        which reads no weight -- under ZeRO-3 they may be released by then)."""
        w_pass = dxs is None
        H = keeps[0].shape[1] if w_pass else ex[0].c_fc.weight.data.shape[0]
        if fn in gemm.OWN_BF16:
            addrs, keep, fresh = self._addresses_bf16(ex, grads=grads, weights=not w_pass)
            _C.grouped_mlp_backward_bf16(xs, dys, counts, addrs, fresh if grads else None, H, h, dxs,
                                         layers.MLP_ROWS, *keeps, fn == "amx")
            del keep
            return
        g, fresh = self._grads_of(ex) if grads else (None, None)
        params = g if w_pass else self._params_of(ex)    # (the W pass reads the gradients' shapes only)
        _C.grouped_mlp_backward(fn, xs, dys, counts, params, g, fresh, h, dxs, layers.MLP_ROWS, *keeps)

    def run_experts(self, xs, counts, experts=None):
        """xs (M, C) rows grouped by expert (counts (E,) rows each) -> (ys (M, C), ctx). experts:
        the modules the groups run through (default this layer's own, in order)."""
        xp = xp_of(xs)
        mods = self.experts if experts is None else experts
        fn = self._grouped_fn(xs, mods)
        if fn is not None:
            return self._run_grouped(fn, xs, counts.tolist(), mods)
        ys = xp.empty_like(xs)
        n = counts.tolist()                              # slice bounds: one host sync on a GPU
        lo = [0, *itertools.accumulate(n)]                # row offsets of each expert (host ints)
        ctxs = [None] * len(n)

        def experts(e0, e1):                             # experts [e0, e1): their rows of ys only
            for e in range(e0, e1):
                if n[e]:
                    ys[lo[e]:lo[e + 1]], c = mods[e].forward(xs[lo[e]:lo[e + 1]])
                    ctxs[e] = (mods[e], lo[e], n[e], c)

        self._over_experts(len(n), experts, xp, n)
        return ys, [c for c in ctxs if c is not None]

    def run_experts_backward(self, dys, ctxs):
        """dys (M, C) -> dxs (M, C); expert parameter grads accumulate."""
        if isinstance(ctxs, tuple) and ctxs and ctxs[0] == "grouped":
            fn = self._grouped_fn(dys, ctxs[1])
            if fn is not None:
                return self._run_grouped_backward(fn, dys, ctxs)
            ctxs = self._loop_ctx(ctxs)              # (a forward grouped, a backward that cannot be)
        dxs = xp_of(dys).zeros_like(dys)

        def experts(i0, i1):                             # ctxs [i0, i1): distinct experts and rows
            for m, lo, n, c in ctxs[i0:i1]:
                dxs[lo:lo + n] = m.backward(dys[lo:lo + n], c)

        self._over_experts(len(ctxs), experts, xp_of(dys), [c[2] for c in ctxs])
        return dxs

    def _loop_ctx(self, ctx):
        """The per-expert loop's ctx from a grouped forward's."""
        _, ex, counts, xs, h = ctx
        out, lo = [], 0
        for m, c in zip(ex, counts.tolist()):
            out.append((m, lo, c, (xs[lo:lo + c], None if h is None else h[lo:lo + c])))
            lo += c
        return out

    @staticmethod
    def _over_experts(n, fn, xp, rows):
        """fn(i0, i1) over n experts: on NumPy split over the kernels' threads (each expert's
        GEMMs are small; whole experts side by side beat the BLAS splitting each one), in
        ranges of about equal rows (routing is rarely even)."""
        if xp is np:
            over_chunks(n, fn, kernels.get_num_threads(), weights=rows)
        else:
            fn(0, n)

    def _named_parameters(self, prefix):
        """The experts under their global ids (expert_lo + local index) when this rank keeps a range."""
        pre = f"{prefix}.experts." if prefix else "experts."
        for name, p in super()._named_parameters(prefix):
            if self.expert_lo and name.startswith(pre):
                j, rest = name[len(pre):].split(".", 1)
                name = f"{pre}{self.expert_lo + int(j)}.{rest}"
            yield name, p

    def run_assignments(self, xs, counts):
        """The kept assignments' rows xs (M, C), grouped by expert (counts (E,)) -> (ys (M, C), ctx):
        through expert_parallel's exchange to the experts' ranks when there is one, else this rank's
        experts (run_experts). A layer whose ranks route the same tokens and split the rows among
        themselves (folded expert layouts, parallel/tp/moe.py) runs its share here and gathers the rest."""
        ep = self.expert_parallel
        return ep.run_experts(xs, counts) if ep is not None else self.run_experts(xs, counts)

    def run_assignments_backward(self, dys, ctx):
        """dys (M, C) -> dxs (M, C): run_assignments' backward."""
        ep = self.expert_parallel
        return ep.run_experts_backward(dys, ctx) if ep is not None else self.run_experts_backward(dys, ctx)

    # --- the experts between routing and combination (expert parallelism's second seam) -------
    def experts_forward(self, xf, rows, gate_rows, counts):
        """xf (N, C) tokens; the kept assignments grouped by expert (counts (E,)): rows (M,) the
        token of each, gate_rows (M,) its gate -> (y (N, C) = the gated sum of each token's expert
        outputs, ctx). Node-aware expert parallelism takes this pair over (it combines in place)."""
        ep = self.expert_parallel
        if ep is not None and ep.takes(xf):
            return ep.node_forward(xf, rows, gate_rows, counts)
        xs = kernels.permute(xf, rows)                                     # (M, C)
        ys, ectx = self.run_assignments(xs, counts)
        return kernels.unpermute_add(ys, rows, gate_rows, xf.shape[0]), (ys, ectx)

    def experts_backward(self, dyf, ctx, rows, gate_rows):
        """dyf (N, C) -> (dxf (N, C), dgate_rows (M,): d loss / d gate of each assignment)."""
        ep = self.expert_parallel
        if ep is not None and ep.owns(ctx):
            return ep.node_backward(dyf, ctx)
        ys, ectx = ctx
        dys_raw = kernels.permute(dyf, rows)                               # (M, C)
        dgate_rows = xp_of(dyf).einsum("mc,mc->m", dys_raw.astype(self._acc, copy=False),
                                       ys.astype(self._acc, copy=False))   # (M,)
        dys = dys_raw * gate_rows[:, None].astype(dys_raw.dtype)
        dxs = self.run_assignments_backward(dys, ectx)
        return kernels.unpermute_add(dxs, rows, None, dyf.shape[0]), dgate_rows

    # --- forward / backward ------------------------------------------------------------------
    def forward(self, x):                        # x (B, T, C) -> y (B, T, C)
        B, T, C = x.shape
        N, E, k, acc = B * T, self.n_expert, self.top_k, self._acc
        xp = xp_of(x)
        xf = x.reshape(N, C)
        xa = xf.astype(acc, copy=False)
        logits = xa @ self.router.weight.data.astype(acc, copy=False).T   # (N, E)
        m = logits.max(axis=1, keepdims=True)
        ez = xp.exp(logits - m)
        s = ez.sum(axis=1, keepdims=True)
        probs = ez / s                                                     # (N, E)
        lse = (m + xp.log(s))[:, 0]                                        # (N,)
        idx, _ = kernels.topk(probs + self.expert_bias, k)                 # (N, k)
        psel = xp.take_along_axis(probs, idx, axis=1)                      # (N, k)
        ssum = psel.sum(axis=1, keepdims=True)
        gates = psel / ssum if k > 1 else psel                             # (N, k)
        # assignments in choice-major priority order: (k, N) flattened
        a_expert = idx.T.reshape(-1)
        a_token = xp.tile(xp.arange(N), k)
        cpr = self.cp_routing                    # context parallelism: the micro-batch spans ranks
        if cpr is None:
            pos, counts = kernels.capacity_positions(a_expert, E, self.capacity(N))
            mb_counts, mb_n = counts, N
        else:
            mb_n = N * cpr.comm.size
            cap = self.capacity(mb_n)
            if cap == 0:                         # dropless: only the counts are the micro-batch's
                pos, counts = kernels.capacity_positions(a_expert, E, 0)
                mb_counts = cpr.counts(counts)
            else:                                # drops decided in the micro-batch's priority order
                pos, mb_counts = cpr.capacity_positions(a_expert, E, cap, k, B)
                counts = xp.bincount(a_expert, minlength=E)
        kept = xp.flatnonzero(pos >= 0)
        order = kept[_stable_argsort(a_expert[kept])]            # (M,) grouped by expert
        rows = a_token[order]                                              # (M,) token of each row
        gate_rows = gates.T.reshape(-1)[order]                             # (M,)
        kept_counts = xp.bincount(a_expert[order], minlength=E)
        y, ectx = self.experts_forward(xf, rows, gate_rows, kept_counts)  # (N, C)
        shctx = None
        if self.shared is not None:
            ysh, shctx = self.shared.forward(xf)
            y += ysh
        f = mb_counts.astype(acc) / (mb_n * k)
        aux = self.aux_coef * E * float((f * probs.mean(axis=0)).sum())
        z = self.z_coef * float((lse * lse).mean())
        if self.recording:
            load, dropped, total = self._stats
            self._stats = load + counts, dropped + (k * N - len(order)), total + k * N
            self._load_since_update += counts
        ctx = dict(shape=x.shape, xf=xf, probs=probs, lse=lse, idx=idx, gates=gates, ssum=ssum,
                   order=order, rows=rows, gate_rows=gate_rows, ectx=ectx, shctx=shctx,
                   f=f, counts=counts, aux_loss=aux + z, aux=aux, z=z)
        if self.recording and self.expert_parallel is not None:
            self.expert_parallel.record_routing(ctx)
        return y.reshape(B, T, C), ctx

    def backward(self, dy, ctx, daux=1.0):       # dy (B, T, C) -> dx (B, T, C)
        B, T, C = ctx["shape"]
        N, E, k, acc = B * T, self.n_expert, self.top_k, self._acc
        xp = xp_of(dy)
        dyf = dy.reshape(N, C)
        dxf, dgate_rows = self.experts_backward(dyf, ctx["ectx"], ctx["rows"], ctx["gate_rows"])
        if self.shared is not None:
            dxf += self.shared.backward(dyf, ctx["shctx"])
        # gates -> chosen probabilities -> all probabilities
        dgates = xp.zeros(k * N, dtype=acc)
        dgates[ctx["order"]] = dgate_rows
        dgates = dgates.reshape(k, N).T                                    # (N, k)
        gates, probs, lse = ctx["gates"], ctx["probs"], ctx["lse"]
        if k > 1:
            dpsel = (dgates - (dgates * gates).sum(axis=1, keepdims=True)) / ctx["ssum"]
        else:
            dpsel = dgates
        dprobs = xp.zeros((N, E), dtype=acc)
        dprobs[xp.arange(N)[:, None], ctx["idx"]] = dpsel                 # top-k experts are distinct
        dprobs += (daux * self.aux_coef * E / N) * ctx["f"]                # aux loss, via P_i
        dlogits = probs * (dprobs - (dprobs * probs).sum(axis=1, keepdims=True))
        dlogits += (daux * self.z_coef * 2.0 / N) * lse[:, None] * probs  # z-loss
        wr, xf = self.router.weight, ctx["xf"]
        weight_grad(wr, lambda: dlogits.T @ xf.astype(acc, copy=False))   # (E, C): the W pass
        dxf += (dlogits @ wr.data.astype(acc, copy=False)).astype(dxf.dtype, copy=False)
        return dxf.reshape(B, T, C)

    # --- statistics and aux-loss-free balancing ------------------------------------------------
    def take_stats(self):
        """{tokens_per_expert, dropped_fraction} since the last call; resets the counters."""
        load, dropped, total = self._stats
        self._stats = xp_of(load).zeros(self.n_expert, np.int64), 0, 0
        return dict(tokens_per_expert=load.tolist(), dropped_fraction=dropped / total if total else 0.0)

    def update_expert_bias(self, loads=None):
        """bias += rate * sign(mean_load - load) over the loads since the last update: this
        layer's own counts, or ``loads`` (tokens per expert, e.g. summed over the data-parallel
        replicas, so that every replica moves its bias alike)."""
        xp = xp_of(self.expert_bias)
        load = xp.asarray(self._load_since_update if loads is None else loads, dtype=np.int64)
        if self.bias_update_rate > 0 and load.sum() > 0:
            self.expert_bias += self.bias_update_rate * xp.sign(load.mean() - load)
        self._load_since_update = xp.zeros(self.n_expert, np.int64)


class MoEBookkeeping:
    """The MoE statistics and bias updates of a model whose ``moe_layers()`` lists its
    (block index, MoE) pairs: nn.GPT and a pipeline rank's PipelineGPT alike."""

    def moe_stats(self):
        return [dict(layer=i, **m.take_stats()) for i, m in self.moe_layers()]

    def update_expert_bias(self, loads=None):
        """Every MoE layer's bias update; ``loads``: {layer index: tokens per expert} to use
        instead of the layers' own counts (the runner passes the global ones)."""
        for i, m in self.moe_layers():
            m.update_expert_bias(None if loads is None else loads[i])
