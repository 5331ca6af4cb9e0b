"""Expert dispatch + combine: the flat alltoallv against the node-aware two-hop route.

    python bench/moe_dispatch.py                 # 2 x 1, 2 x 2, 2 x 4 and 4 x 2 ranks; top-k 2, 4, 8
    python bench/moe_dispatch.py --quick         # 4 ranks, 2 nodes x 2, top-k 2 and 4 (the smoke test)

Each row is one ``mpiexec`` launch of this file's worker over all ranks as one ep group holding
``--experts`` experts, on a simulated topology:

    shm       PYMPAR_RANKS_PER_NODE=k: pympar sees nodes of k ranks; every message goes through
              MPICH's shared memory (what the route costs where nodes are only pympar's idea)
    network   MPIR_CVAR_NUM_CLIQUES=n: MPICH makes n "nodes" that share memory inside and talk
              through its network module between them (what ranks on different hosts use)

One MoE layer's token exchange per rank: ``--tokens`` tokens of ``--width`` float32 each, routed
top-k to distinct experts drawn uniformly (a balanced router), no drops; the experts are the
identity, so the time is dispatch + combine alone, everything the layer does around its experts
(the flat path: permute, counts alltoall, two alltoallv, the gated scatter-add; the node path: the
plan with its columns, two hops out, the per-rank and per-node sums, two hops back). Both give the
same y (checked, to float32 rounding of k terms). Bytes across nodes: rows this rank sends to a
rank on another node, both directions, summed over ranks. Time: per round the slowest rank's, the
median over rounds. 8 ranks oversubscribe the 2 cores: the times are ratios of one run.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

TOPOLOGIES = {"shm": "PYMPAR_RANKS_PER_NODE", "network": "MPIR_CVAR_NUM_CLIQUES"}
TARGET_BYTES, TARGET_NET = 0.5, 1.3


def worker(a):
    import numpy as np
    from mpi4py import MPI

    from pympar import config, kernels
    from pympar.comm import MPIComm
    from pympar.comm.algorithms.node_a2a import NodeRoute
    from pympar.parallel.ep import _expert_major

    config.apply_environment()                  # PYMPAR_RANKS_PER_NODE: the simulated nodes
    kernels.set_num_threads(1)
    world = MPI.COMM_WORLD
    comm = MPIComm(world, name="ep", timeout=600)
    route = NodeRoute.build(comm)
    assert route is not None, "the topology must give several nodes of equal size"
    P, me, E, N, C = comm.size, comm.rank, a.experts, a.tokens, a.width
    nl = E // P
    rng = np.random.default_rng([7, me])
    x = rng.standard_normal((N, C)).astype(np.float32)
    out = []
    for k in a.topk:
        choice = np.argsort(rng.random((N, E)), axis=1)[:, :k]                 # k distinct experts a token
        gates = rng.random((N, k)).astype(np.float32)
        a_expert, a_token = choice.T.reshape(-1), np.tile(np.arange(N), k)     # choice-major, as nn.moe
        order = np.argsort(a_expert, kind="stable")
        rows, g = a_token[order], gates.T.reshape(-1)[order]
        counts = np.bincount(a_expert, minlength=E)
        dest = a_expert[order] // nl

        def flat():                              # parallel/ep.py's run_experts, the experts the identity
            xs = kernels.permute(x, rows)
            per = np.ascontiguousarray(counts.reshape(P, nl))
            recv_by = np.asarray(comm.alltoall(per)).reshape(P, nl)
            send, recv = per.sum(axis=1), recv_by.sum(axis=1)
            xr, _ = comm.alltoallv(xs, send, recv)
            perm = _expert_major(recv_by)
            yg = kernels.permute(xr, perm)                                  # expert-major, as the experts take it
            yr = np.empty_like(yg)
            yr[perm] = yg
            ys, _ = comm.alltoallv(yr, recv, send)
            return kernels.unpermute_add(ys, rows, g, N)

        def node():
            plan = route.plan(rows, dest, np.stack([a_expert[order] - dest * nl, g.astype(np.float64).view(np.int64)], 1))
            xr = plan.dispatch(x)
            gg = plan.meta[:, 1].copy().view(np.float64).astype(np.float32)
            z = kernels.unpermute_add(kernels.permute(xr, plan.arow), plan.arow, gg, plan.n_rows)
            return plan.combine(z, N)

        y_flat, y_node = flat(), node()
        np.testing.assert_allclose(y_node, y_flat, rtol=1e-5, atol=1e-5 * float(np.abs(y_flat).max()))
        remote = route.node_of[dest] != route.node_of[me]
        flat_rows = 2 * int(remote.sum())                                   # out and back
        before = route.rows_across
        plan = route.plan(rows, dest, np.zeros((len(rows), 1), np.int64))
        node_rows = 2 * (route.rows_across - before)                        # hop 1 out, the same rows back
        times = {"flat": [], "node": []}
        for r in range(a.rounds + 1):
            for name, fn in (("flat", flat), ("node", node)):
                world.Barrier()
                t0 = time.perf_counter()
                fn()
                dt = world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
                if r:
                    times[name].append(dt)
        fr, nr = world.allreduce(flat_rows), world.allreduce(node_rows)
        out.append(dict(top_k=k, flat_bytes_across=fr * C * 4, node_bytes_across=nr * C * 4,
                        bytes_ratio=nr / fr if fr else None, flat_s=statistics.median(times["flat"]),
                        node_s=statistics.median(times["node"]), nodes=route.n_nodes, ranks_per_node=route.node.size))
        out[-1]["speedup"] = out[-1]["flat_s"] / out[-1]["node_s"]
        del plan
    route.free()
    if me == 0:
        print("ROWS " + json.dumps(out), flush=True)


def run(a):
    rows = []
    shapes = ((4, 2),) if a.quick else ((2, 1), (4, 2), (8, 4), (8, 2))        # (ranks, ranks per node)
    cases = [(t, n, k) for t in ("shm", "network") for (n, k) in shapes]
    for transport, n, per_node in cases:
        got = common.run_worker(n, __file__, ["--experts", a.experts, "--tokens", a.tokens, "--width", a.width,
                                              "--rounds", a.rounds, "--topk", ",".join(map(str, a.topk))], a.timeout,
                                {TOPOLOGIES[transport]: per_node if transport == "shm" else n // per_node})
        for r in got:
            r.update(transport=transport, ranks=n)
            print(f"  {transport:<8} {n} ranks = {r['nodes']} x {r['ranks_per_node']}  top-{r['top_k']}: bytes across "
                  f"nodes {r['bytes_ratio']:.2f}x flat, time flat {1e3 * r['flat_s']:7.2f} ms  node "
                  f"{1e3 * r['node_s']:7.2f} ms  ({r['speedup']:.2f}x)", file=sys.stderr, flush=True)
        rows += got
    targets = {}
    for t in ("shm", "network"):                 # the setting: 2 nodes of 4 ranks, top-4
        r = next((r for r in rows if r["transport"] == t and r["nodes"] == 2 and r["ranks_per_node"] == 4
                  and r["top_k"] == 4), None)
        if r is None:
            continue
        if t == "shm":
            targets[f"node-aware bytes across nodes / flat, 2 nodes x 4, top-4 (target <= {TARGET_BYTES})"] = r["bytes_ratio"]
        bound = 1.0 if t == "shm" else TARGET_NET
        targets[f"node-aware dispatch+combine speed-up over flat, {t}, 2 nodes x 4, top-4 (target >= {bound})"] = \
            r["speedup"]
    return dict(machine=common.machine(), experts=a.experts, tokens=a.tokens, width=a.width, rows=rows,
                targets=targets)


def plot(res, path):
    plt = common.pyplot()
    if plt is None:
        return
    rows = res["rows"]
    groups = list(dict.fromkeys((r["transport"], r["nodes"], r["ranks_per_node"]) for r in rows))
    ks = sorted({r["top_k"] for r in rows})
    fig, axes = plt.subplots(2, 1, figsize=(9.6, 6.0), sharex=True)
    w = 0.8 / len(ks)
    for i, k in enumerate(ks):
        for ax, key in zip(axes, ("bytes_ratio", "speedup")):
            ys = [next((r[key] for r in rows if (r["transport"], r["nodes"], r["ranks_per_node"]) == g
                        and r["top_k"] == k), 0) for g in groups]
            ax.bar([j + i * w for j in range(len(groups))], ys, w, label=f"top-{k}")
    axes[0].axhline(TARGET_BYTES, color="k", ls="--", lw=0.8)
    axes[0].set_ylabel("bytes across nodes\nnode-aware / flat")
    axes[1].axhline(1.0, color="k", ls="--", lw=0.8)
    axes[1].set_ylabel("dispatch+combine\nspeed-up over flat")
    axes[1].set_xticks([j + w * (len(ks) - 1) / 2 for j in range(len(groups))],
                       [f"{t}\n{n} nodes x {k}" for t, n, k in groups], fontsize=8)
    axes[0].legend(fontsize=8)
    axes[0].set_title(f"MoE token exchange: {res['tokens']} tokens x {res['width']} float32 per rank, "
                      f"{res['experts']} experts (more than 2 ranks share 2 cores)", fontsize=10)
    common.save(fig, path)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = common.worker_parser(__doc__)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--topk", type=lambda s: [int(v) for v in s.split(",")], default=None)
    ap.add_argument("--timeout", type=float, default=1200)
    if "--worker" in argv:
        a = ap.parse_args(argv)
        worker(a)
        return 0
    common.add_output_args(ap, "moe_dispatch")
    a = common.resolve_outputs(ap.parse_args(argv))
    if a.topk is None:
        a.topk = [2, 4] if a.quick else [2, 4, 8]
    if a.quick:
        a.rounds, a.tokens = min(a.rounds, 3), min(a.tokens, 256)
    res = run(a)
    common.write_outputs(a, res, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
