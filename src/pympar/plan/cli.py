"""Auto-parallel planner: which layout to run before spending machine time (the cost model
and the search are pympar/layout.py's; this is their command line, calibration and measurement).

    python -m pympar.plan --preset small --world 8 --global-batch 32
    python -m pympar.plan --preset gpt2-124m --world 64 --ranks-per-node 8 --device h100 \\
        --mem-per-rank 80GiB --global-batch 512
    python -m pympar.plan --preset small --world 4 --bench-json allreduce.json --measure

For every valid layout (dp, pp, tp, ep, micro-batch size and count, schedule, ZeRO stage 0-3,
sequence parallelism, activation recomputation) it predicts the memory per rank and the step time, prints the best
candidates and why the others were rejected. ``--measure`` runs the top candidates for a few
steps with the real trainer and prints predicted against measured step time.

The model (all costs per rank, per optimiser step):

  memory  = the ledger of the worst pipeline rank (pympar.parallel.ledger.predict: the same
            categories a run measures -- parameters, gradients, optimizer state, activations
            times the micro-batches in flight of the schedule's own action list, communication
            buffers, workspace -- for its ZeRO stage and recomputation) + the process baseline
            (this planner's own resident memory at start; 0 for --layout auto, whose ranks
            must agree without communicating)
  compute = per micro-batch and stage: flops_per_token * tokens / (pp * tp) at the matmul
            rate, + elem_time * the activation elements the stage produces (the non-matmul
            work: layernorm, residual adds, GELU, softmax; with tensor parallelism the
            layernorm/residual part is replicated on every TP rank, not divided, unless
            sequence parallel: counted by activations_per_micro's own split), + overhead per
            block (Python dispatch of every op, independent of the micro-batch size)
  tp comm = per micro-batch 4 allreduces per block (2 forward, 2 backward) of B*T*C, + 3 for
            the vocab-parallel embedding and cross-entropy; each pays the latency alpha
  ep comm = 4 all-to-alls per MoE block per micro-batch of B*T*k*C
  pp comm = one send forward and one backward of B*T*C per micro-batch and stage boundary
  pipeline: the schedule simulator of pympar.parallel.pp runs the per-rank action lists with
            these forward/backward costs, which gives the bubble
  dp comm = one allreduce of the rank's gradients; ZeRO-1 a reduce-scatter + an allgather;
            ZeRO-2 a reduce-scatter per micro-batch + an allgather; ZeRO-3 per micro-batch a
            reduce-scatter and two allgathers (forward and backward); ``overlap`` of it is hidden
            behind backward
  optimiser = opt_per_param * the rank's parameters (ZeRO: / dp)
  recompute = full: the forward again in backward (compute x 4/3, less a dense MLP's c_proj,
            which is not run again); selective: a dense MLP's c_fc (without tp) and, on the
            materialized attention, the attention scores' share of it
A layout that does not fit in memory is rejected, so the fastest that fits wins: ZeRO and
recomputation are chosen exactly when memory demands them.
Oversubscribed CPU (more ranks on a node than cores): every rank computes slower than alone
            for the whole step, waiting or not: a rank waiting in a pipeline bubble or for a
            collective polls (pympar's oversubscribed polling yields, but the yielding rank
            stays runnable and the scheduler keeps giving it its share), so the bubble is NOT
            given to the busy ranks. Compute and optimiser costs are multiplied by the
            ranks / cores times the excess over it that the calibration measured (copies of
            the one-process run at once: 2.05-2.29 at 4 ranks, 4.19-5.32 at 8 in three
            calibrations on the 2-core VM, 2026-12-08, against 2 and 4: each core's caches
            are shared by the ranks it switches between), 1 where every rank has a core;
            the collectives' alpha and
            beta are measured at the rank count. And on such a node each tensor- or
            expert-parallel collective, reached from compute, waits for the last rank: the
            calibration's arrival spread after a burst as long as the compute between two
            such collectives (Machine.arrival; a tight loop of collectives does not see it,
            every rank being inside one). Measured (bench/results/plan_accuracy.json,
            2026-12-08, the AMD EPYC VM, 3 runs per layout; its measurements predicted with
            and without the terms): without them (and with the float32 peak the calibration
            used to time) measured / predicted 1.05-2.29 at 4 ranks and 1.09-2.39 at 8, rank
            correlation 0.54 and 0.76; with the compute slowdown alone 0.94-1.78 and
            1.05-2.03 (0.65, 0.90); with both 0.94-1.67 and 1.03-1.45 (0.81, 0.98: the
            arrival spread sets the ranking, the tensor-parallel layouts'). Earlier
            (2026-11-29): dp2 pp2 GPipe m=2 1.50x dp4's
            step and dp1 pp4 GPipe m=4 1.65x, against bubble factors (m+p-1)/m of 1.50 and
            1.75. 1F1B's short interleaved waits cost somewhat less than the full factor
            (1.13x measured for dp2 pp2 m=4 against 1.25), which the model does not capture.
Where the constants come from on a CPU (bench/plan_calibrate.py, --calibration FILE), from
microbenchmarks that are not the layouts being ranked:
  peak        the best of short matmul bursts of one process in the dtype the trainer's
              --dtype auto computes in here (bf16 on the bf16 engine, 512^3; else float32,
              256^3). It was float32 until 2026-12-08: on a CPU with native bf16 the step's
              products ran at about twice that rate, the fit below put all of a sequence's
              time into products and none into the elementwise work that tensor parallelism
              repeats on every rank (elem_time 0). (Without a calibration the planner times
              a float32 burst: MFU_ASSUMED["cpu"] was fitted to it.)
  overhead, elem_time, opt_per_param
              one process (no communication) stepping the model at several micro-batch sizes
              B and counts m: the plane t = step_fixed + m * micro_fixed + m * B * per_seq;
              overhead = micro_fixed / (n_layer + 2), elem_time = (per_seq - matmul time of
              one sequence at ``peak``) / one sequence's activation elements, opt_per_param
              = step_fixed / the model's parameters (negative intercepts, noise around a
              cost too small to see, count as 0). When one sequence's FLOPs at ``peak`` take
              longer than per_seq (measured: the small preset's step ran at 1.2x the burst
              rate), peak is raised to FLOPs / per_seq and elem_time is 0.
  alpha, beta ``pympar.bench allreduce --algo auto`` at the layouts' rank count k: alpha = the
              smallest message's time / ceil(log2 k) (Machine.coll charges alpha per round of
              a log2(k)-round allreduce, and one round to a pipeline send), beta = its busbw
              at >= 1 MiB. On the 2-core VM: 15-74 us for 8 B at 4 and 8 ranks (2026-12-08;
              1.7 and 4.3 ms on 2026-11-29, when a waiting rank slept: that latency then held
              the arrival spread below, which the tight loop no longer shows).
  slowdown    k copies of the one-process run at once (one per rank of the layouts' count k),
              their median step over the step alone (at other rank counts its excess over
              k / cores scales ranks / cores).
  arrival     at k ranks, bursts of compute with and without a 4 KiB allreduce after each:
              the extra time beyond the allreduce alone, at bursts of 1-16 repeats; made
              non-decreasing in the burst (monotone) and interpolated (Machine.arrival).
Without a calibration file the CPU constants are CPU_DEFAULT (measured once on the 2-core VM,
see docs/benchmarks.md) and the matmul peak is measured when the planner starts.
Collectives follow the alpha-beta model t(n) = alpha + n / beta with the algorithm's bus
factor (allreduce 2(k-1)/k, reduce-scatter/allgather/all-to-all (k-1)/k); alpha and beta come
from ``pympar.bench --json`` files of this machine (intra-node), or from the device table.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from ..config import check_output_file, child_environment, start_application
from ..layout import Layout
from ..metrics import measure_matmul_peak
from ..nn.config import PRESETS, GPTConfig, flops_per_token
from ..parallel import ledger
from .cost import (CPU_DEFAULT, DEVICES, GiB, MFU_ASSUMED, Machine, activations_per_micro, parse_bytes, params_per_rank,
                   plan)


def _read_json(path, flag: str):
    """The JSON in ``path``; ValueError naming the flag and the file when it cannot be read or parsed."""
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror or e}") from None
    except ValueError as e:                      # (json.JSONDecodeError, UnicodeDecodeError)
        raise ValueError(f"{flag} {path}: not a JSON file ({e})") from None


def fit_alpha_beta(paths, nranks: int | None = None) -> tuple:
    """(alpha s, busbw bytes/s) fitted to the best algorithm's rows of pympar.bench --json files
    (or bench/collectives.py's, which hold several collectives and rank counts).

    Only allreduce rows are used, and of those the rank count closest to ``nranks`` when
    given. alpha = the smallest message's time; beta = the best bus bandwidth at >= 1 MiB."""
    rows = []
    for p in paths:
        data = _read_json(p, "--bench-json")
        top = data if isinstance(data, dict) else {}
        listed = data["rows"] if isinstance(data, dict) and "rows" in data else data
        if not isinstance(listed, list) or not all(isinstance(r, dict) for r in listed):
            raise ValueError(f"--bench-json {p}: not a pympar.bench --json result (a list of rows, or an object "
                             f"with 'rows')")
        for r in listed:
            r = dict(r)
            r.setdefault("collective", top.get("collective", "allreduce"))
            r.setdefault("nranks", top.get("nranks"))
            if r["collective"] == "allreduce":
                rows.append(r)
    if nranks and rows:
        have = {r["nranks"] for r in rows if r["nranks"]}
        if have:
            near = min(have, key=lambda k: (abs(k - nranks), -k))
            rows = [r for r in rows if r["nranks"] == near]
    alphas, bws = [], []
    for r in rows:
        size = r.get("size") or r.get("size_bytes") or r.get("bytes")
        t = r.get("time_us") or r.get("oop_time_us") or (r.get("out_of_place") or {}).get("time_us")
        bus = r.get("busbw") or r.get("oop_busbw") or (r.get("out_of_place") or {}).get("busbw")
        if size is None or t is None:
            continue
        if size <= 64:
            alphas.append(t * 1e-6)
        if size >= 1 << 20 and bus:
            bws.append(bus * 1e9)
    if not alphas or not bws:
        raise ValueError(f"no usable rows in {list(paths)}: expected `python -m pympar.bench allreduce --json` "
                         f"output with size and time columns, including sizes <= 64 B and >= 1 MiB")
    return min(alphas), max(bws)



def node_memory() -> int:
    """What this node can give a job now (ledger.available_memory), else its physical memory."""
    return ledger.available_memory() or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def build_machine(args) -> Machine:
    if args.device == "cpu":
        # the best of short bursts: a shared machine's load only ever lowers a burst's rate.
        # Ranks beyond the cores are modelled in predict() (Machine.cores), not here.
        peak = args.peak_flops or max(measure_matmul_peak(seconds=0.05) for _ in range(6))
        cores = os.cpu_count() or 1
        d = dict(CPU_DEFAULT)
        # this node's memory now, as the trainer's --memory-check reads it, shared by its ranks
        mem = parse_bytes(args.mem_per_rank) if args.mem_per_rank else node_memory() // max(1, args.ranks_per_node)
        mfu, overlap = MFU_ASSUMED["cpu"], 0.0
        d["baseline"] = 0 if getattr(args, "deterministic", False) else ledger.proc_status_bytes("VmRSS")
    else:
        d = dict(DEVICES[args.device])
        peak = args.peak_flops or d["peak"]
        mem = parse_bytes(args.mem_per_rank) if args.mem_per_rank else d["mem"]
        mfu, overlap, cores = MFU_ASSUMED["gpu"], 0.8, 0
    cal = getattr(args, "calibration", None)
    if cal:
        if args.device != "cpu":
            raise ValueError(f"--calibration describes this CPU machine; it does not apply to --device {args.device}")
        c = load_calibration(cal, args.ranks_per_node or args.world)
        peak = args.peak_flops or c.pop("peak")
        d.update(c)
    if args.bench_json:
        d["alpha"], d["intra_bw"] = fit_alpha_beta(args.bench_json, nranks=args.ranks_per_node or args.world)
    if args.overlap is not None:
        overlap = args.overlap
    return Machine(peak=peak, alpha=d["alpha"], intra_bw=d["intra_bw"], inter_bw=d["inter_bw"], mem=mem,
                   act_bytes=d["act_bytes"], mfu=mfu, ranks_per_node=args.ranks_per_node or args.world,
                   overlap=overlap, overhead=d["overhead"], cores=cores, elem_time=d.get("elem_time", 0.0),
                   opt_per_param=d.get("opt_per_param", 4e-9), baseline=int(d.get("baseline", 0)),
                   arrival_curve=d.get("arrival_curve", ()), slowdown=d.get("slowdown", ()))


def monotone(points) -> tuple:
    """The closest non-decreasing curve to ``points`` [(x, y)] sorted by x, in least squares (pool
    adjacent violators): the arrival spread grows with the burst, and a noisy point below its left
    neighbour is averaged with it rather than kept or dropped."""
    blocks = []                                  # [sum y, count] of pooled runs
    for _, y in points:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, n = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += n
    ys = [s / n for s, n in blocks for _ in range(n)]
    return tuple((x, y) for (x, _), y in zip(points, ys))


def load_calibration(path, nranks: int) -> dict:
    """Machine constants from a bench/plan_calibrate.py JSON file or its dict (see the module docstring):
    peak, overhead, elem_time, opt_per_param, and alpha/intra_bw of the rank count nearest
    ``nranks``."""
    c = path if isinstance(path, dict) else _read_json(path, "--calibration")
    try:
        cfg = GPTConfig.from_preset(c["preset"])
        sp = c["single_process"]
        peak = c["matmul_peak"]
        T = cfg.block_size
        one = Layout()
        elem = activations_per_micro(cfg, one, range(cfg.n_layer), True)
        per_seq = sp["per_seq_s"]
        if per_seq <= 0:
            raise ValueError(f"single_process.per_seq_s={per_seq} must be > 0")
        # the step's GEMMs can run faster than the burst (larger, better blocked): then
        # the whole sequence time is the matmul rate's and nothing is left for elem_time
        peak = max(peak, flops_per_token(cfg) * T / per_seq)
        nonmm = per_seq - flops_per_token(cfg) * T / peak
        def nearest(by_ranks: dict) -> str:     # the rank count nearest nranks (ties: the larger)
            return min(by_ranks, key=lambda k: (abs(int(k) - nranks), -int(k)))
        near = nearest(c["allreduce"])
        ar = c["allreduce"][near]
        n_par = params_per_rank(cfg, one, range(cfg.n_layer), True, True)
        # the arrival spread and the slowdown of the nearest rank count too; older calibrations have
        # neither: ranks / cores and no spread
        arr, con = c.get("arrival") or {}, c.get("contention") or {}
        curve = monotone(sorted((float(x), float(y)) for x, y in arr[nearest(arr)]["points"])) if arr else ()
        slowdown = (int(nearest(con)), float(con[nearest(con)]["slowdown"])) if con else ()
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path if not isinstance(path, dict) else 'the calibration'} is not a bench/plan_calibrate.py result ({e!r}): expected preset, matmul_peak, "
                         f"single_process.{{step_fixed_s, micro_fixed_s, per_seq_s}} and allreduce.<ranks>") from None
    return dict(peak=peak, overhead=max(0.0, sp["micro_fixed_s"]) / (cfg.n_layer + 2),
                elem_time=max(0.0, nonmm) / elem, opt_per_param=max(0.0, sp["step_fixed_s"]) / n_par,
                alpha=ar["alpha_s"] / max(1, math.ceil(math.log2(int(near)))), intra_bw=ar["busbw"], arrival_curve=curve,
                slowdown=slowdown)


def format_table(preds, top: int) -> str:
    hdr = f"{'#':>3}  {'layout':<48} {'step(ms)':>9} {'mem/rank':>10} {'bubble':>7} {'tp':>6} {'dp':>6} {'pp':>6} {'cp':>6}"
    lines = [hdr, "-" * len(hdr)]
    for i, p in enumerate(preds[:top]):
        t = p.time
        lines.append(f"{i + 1:>3}  {p.layout.key():<48} {p.step_time * 1e3:>9.2f} "
                     f"{p.memory['total'] / 2**20:>8.1f}Mi {p.bubble:>7.2f} {t['tp_comm'] * 1e3:>6.1f} "
                     f"{t['dp_comm'] * 1e3:>6.1f} {t['pp_comm'] * 1e3:>6.1f} {t.get('cp_comm', 0.0) * 1e3:>6.1f}")
    return "\n".join(lines)


def measure(preds, args, cfg_args) -> list:
    """Run each layout for a few steps with the real trainer; -> rows with measured step time."""
    import subprocess
    import tempfile

    from ..launch import find_mpiexec
    from ..report import read_metrics

    rows = []
    for p in preds:
        with tempfile.TemporaryDirectory() as out:
            cmd = [find_mpiexec(), "-n", str(args.world), sys.executable, "-m", "pympar.train", *cfg_args,
                   *p.layout.train_args(), "--steps", str(args.measure_steps), "--out", out,
                   "--eval-every", "0", "--sample-tokens", "0"]
            env = child_environment(OMP_NUM_THREADS=1, OPENBLAS_NUM_THREADS=1)
            r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.measure_timeout)
            if r.returncode != 0:
                rows.append({"layout": p.layout.key(), "predicted_s": p.step_time, "error": r.stdout[-300:] + r.stderr[-300:]})
                continue
            steps = read_metrics(os.path.join(out, "metrics.jsonl"))
            times = sorted(s["step_time"] for s in steps[1:]) or [steps[0]["step_time"]]
            rows.append({"layout": p.layout.key(), "predicted_s": p.step_time,
                         "measured_s": times[len(times) // 2],
                         "predicted_mem": p.memory["total"],
                         "measured_rss": max(s.get("rss_bytes", 0) for s in steps)})
    return rows


def spearman(a, b) -> float:
    """Rank correlation of two equal-length sequences (ties get their mean rank)."""
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = math.sqrt(sum((x - ma) ** 2 for x in ra))
    vb = math.sqrt(sum((y - mb) ** 2 for y in rb))
    return cov / (va * vb) if va and vb else 0.0


def spearman_null_p95(pred, meas, n_perm: int = 2000, seed: int = 0) -> float:
    """95th percentile of Spearman's rho of ``meas`` against random permutations of ``pred``:
    what a planner that ranks the same layouts at random reaches 1 time in 20."""
    import random
    rng = random.Random(seed)
    p = list(pred)
    null = []
    for _ in range(n_perm):
        rng.shuffle(p)
        null.append(spearman(p, meas))
    null.sort()
    return null[int(0.95 * (len(null) - 1))]


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults appended where they say something: not for None, not where the help names its own."""

    def _get_help_string(self, action):
        h = action.help or ""
        if "default" in h or action.default is None or action.required or action.default is argparse.SUPPRESS:
            return h
        return super()._get_help_string(action)


def main(argv=None) -> int:
    start_application("pympar.plan")
    ap = argparse.ArgumentParser(prog="python -m pympar.plan", description=__doc__.split("\n\n")[0],
                                 formatter_class=_Help)
    ap.add_argument("--preset", default="small", help=f"model preset: {', '.join(PRESETS)}")
    for f in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "n_expert", "top_k", "moe_every"):
        ap.add_argument("--" + f.replace("_", "-"), type=int, default=None, help=f"override the preset's {f}")
    ap.add_argument("--world", type=int, required=True, help="number of ranks")
    ap.add_argument("--ranks-per-node", type=int, default=None, help="ranks per node (default: all in one)")
    ap.add_argument("--mem-per-rank", default=None, help="memory per rank, e.g. 2GiB (default: the device's; on cpu this node's available memory (MemAvailable, or a memory cgroup's room) / ranks-per-node)")
    ap.add_argument("--device", default="cpu", choices=["cpu", *DEVICES], help="cpu (measured) or a GPU model")
    ap.add_argument("--peak-flops", type=float, default=None, help="override the matmul FLOP/s per rank")
    ap.add_argument("--global-batch", type=int, default=None, help="sequences per step (default 4*world)")
    ap.add_argument("--bench-json", nargs="*", default=None, help="pympar.bench --json files for alpha/beta")
    ap.add_argument("--calibration", default=None, help="bench/plan_calibrate.py JSON: this CPU's constants")
    ap.add_argument("--overlap", type=float, default=None, help="fraction of DP sync hidden behind backward, 0-1 "
                    "(default: 0 on cpu, 0.8 on a GPU model)")
    ap.add_argument("--top", type=int, default=10, help="candidates to print")
    ap.add_argument("--show-rejected", type=int, default=10, help="rejected layouts to print")
    ap.add_argument("--json", default=None, help="write every candidate and rejection as JSON")
    ap.add_argument("--measure", type=int, nargs="?", const=3, default=0,
                    help="run the top N candidates (a bare --measure: 3) with the real trainer and compare")
    ap.add_argument("--measure-steps", type=int, default=4, help="--measure: training steps per candidate")
    ap.add_argument("--measure-timeout", type=float, default=600, help="--measure: seconds per candidate")
    args = ap.parse_args(argv)
    for name, ok, want in (("world", args.world >= 1, ">= 1"), ("top", args.top >= 0, ">= 0"),
                           ("show-rejected", args.show_rejected >= 0, ">= 0"), ("measure", args.measure >= 0, ">= 0"),
                           ("measure-steps", args.measure_steps >= 1, ">= 1"),
                           ("measure-timeout", args.measure_timeout > 0, "> 0"),
                           ("ranks-per-node", args.ranks_per_node is None or args.ranks_per_node >= 1, ">= 1"),
                           ("global-batch", args.global_batch is None or args.global_batch >= 1, ">= 1"),
                           ("peak-flops", args.peak_flops is None or 0 < args.peak_flops < float("inf"),
                            "a positive number"),
                           ("overlap", args.overlap is None or 0 <= args.overlap <= 1, "in 0..1")):
        if not ok:
            ap.error(f"--{name}={getattr(args, name.replace('-', '_'))} must be {want}")
    if args.mem_per_rank is not None:
        try:
            if not 0 < parse_bytes(args.mem_per_rank) < float("inf"):
                raise ValueError("must be a positive size")
        except (ValueError, OverflowError) as e:
            ap.error(f"--mem-per-rank {args.mem_per_rank!r}: {e} (e.g. 2GiB)")
    if args.json:
        try:
            check_output_file(args.json)
        except ValueError as e:
            ap.error(f"--json {args.json}: {e}")
    if args.measure:
        from ..launch import LaunchError, find_mpiexec
        try:
            find_mpiexec()
        except LaunchError as e:
            ap.error(f"--measure: {e}")
    over = {f: getattr(args, f) for f in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size",
                                         "n_expert", "top_k", "moe_every") if getattr(args, f) is not None}
    try:
        cfg = GPTConfig.from_preset(args.preset, **over)
        if args.world < 1:
            raise ValueError(f"--world={args.world} must be >= 1")
    except ValueError as e:
        ap.error(str(e))
    args.ranks_per_node = args.ranks_per_node or args.world
    gb = args.global_batch or 4 * args.world
    try:
        machine = build_machine(args)
    except (OSError, ValueError) as e:              # --calibration, --bench-json: unreadable or not theirs
        ap.error(str(e))
    from tqdm import tqdm                          # a bar on a terminal only (disable=None), on stderr
    with tqdm(desc="planning", unit=" layouts", disable=None, mininterval=0.5, leave=False) as bar:
        preds, rejected = plan(cfg, args.world, gb, machine, progress=bar.update)
    print(f"model {args.preset} ({cfg.n_layer} layers, C={cfg.n_embd}, heads={cfg.n_head}, experts={cfg.n_expert}); "
          f"world {args.world}, {args.ranks_per_node} ranks/node, global batch {gb}; device {args.device}: "
          f"peak {machine.peak / 1e9:.1f} GFLOP/s/rank, alpha {machine.alpha * 1e6:.1f} us, "
          f"bus {machine.intra_bw / 1e9:.2f} GB/s, memory {machine.mem / GiB:.1f} GiB/rank")
    if not preds:
        print("no layout fits.")
    else:
        print(format_table(preds, args.top))
    if rejected and args.show_rejected:
        print(f"\nrejected ({len(rejected)}), one per reason, first {args.show_rejected} reasons:")
        seen = set()
        for key, why in rejected:
            if why in seen:
                continue
            seen.add(why)
            print(f"  {key}: {why}")
            if len(seen) >= args.show_rejected:
                break
    out = {}
    if args.measure and preds:
        cfg_args = ["--preset", args.preset] + [x for f, v in over.items() for x in ("--" + f.replace("_", "-"), str(v))]
        rows = measure(preds[:args.measure], args, cfg_args)
        print(f"\n{'layout':<48} {'predicted(ms)':>14} {'measured(ms)':>13}")
        for r in rows:
            print(f"{r['layout']:<48} {r['predicted_s'] * 1e3:>14.2f} "
                  + (f"{r['measured_s'] * 1e3:>13.2f}" if "measured_s" in r else f"  failed: {r['error'][-120:]}"))
        good = [r for r in rows if "measured_s" in r]
        if len(good) >= 3:
            rho = spearman([r["predicted_s"] for r in good], [r["measured_s"] for r in good])
            print(f"rank correlation (Spearman) predicted vs measured: {rho:.2f}")
            out["spearman"] = rho
        out["measured"] = rows
    if args.json:
        out = {"candidates": [p.row() for p in preds], "rejected": [{"layout": k, "reason": r} for k, r in rejected],
               **out}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0

