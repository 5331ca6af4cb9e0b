"""algo="auto": pick an algorithm from message size and topology.

A table maps collective -> topology class -> ascending [max_bytes, algo] rows; the first
row whose max_bytes >= the message size wins. ``python -m pympar.bench <coll> --tune FILE``
measures every algorithm on the machine and writes such a table; point PYMPAR_TUNING at it
(rank 0 reads it and broadcasts it, so every rank decides alike).
"""
from __future__ import annotations

import json
import os

INF = float("inf")

# Measured on the 2-core development machine with MPICH 5 (docs/comm.md); sizes in bytes.
# allreduce: the library up to 8 KiB, then the chunked shm allreduce (it wins from 16 KiB at
# 4 ranks and 32 KiB at 2 ranks, and by 1.5-3.5x at 16-64 MiB)
DEFAULT_TABLE = {
    "allreduce": {
        "single_node": [[8192, "mpi"], [INF, "shm"]],
        "multi_node": [[65536, "recursive_doubling"], [INF, "hierarchical"]],
    },
    "reduce_scatter": {
        "single_node": [[2048, "mpi"], [INF, "shm"]],
        "multi_node": [[65536, "recursive_halving"], [INF, "ring"]],
    },
    "allgather": {
        "single_node": [[2048, "mpi"], [INF, "shm"]],
        "multi_node": [[65536, "recursive_doubling"], [INF, "ring"]],
    },
    "broadcast": {
        "single_node": [[2048, "mpi"], [INF, "shm"]],
        "multi_node": [[INF, "mpi"]],
    },
}


def topology_class(single_node: bool) -> str:
    return "single_node" if single_node else "multi_node"


def load_table(path=None):
    """The table in ``path`` (or $PYMPAR_TUNING), merged over the default."""
    path = path or os.environ.get("PYMPAR_TUNING")
    table = json.loads(json.dumps(DEFAULT_TABLE))
    if path and os.path.exists(path):
        with open(path) as f:
            user = json.load(f)
        for coll, by_topo in user.items():
            for topo, rows in by_topo.items():
                table.setdefault(coll, {})[topo] = [[float(b), a] for b, a in rows]
    return table


def choose(table, coll: str, nbytes: int, single_node: bool) -> str:
    rows = table.get(coll, {}).get(topology_class(single_node))
    if not rows:
        return "mpi"
    for max_bytes, algo in rows:
        if nbytes <= max_bytes:
            return algo
    return rows[-1][1]


def table_from_results(results, coll: str, single_node: bool):
    """Build table rows from benchmark rows {bytes, algo, time_us}: the fastest per size."""
    best = {}
    for row in results:
        b = row["bytes"]
        if b not in best or row["time_us"] < best[b][1]:
            best[b] = (row["algo"], row["time_us"])
    rows = []
    for b in sorted(best):
        algo = best[b][0]
        if rows and rows[-1][1] == algo:
            rows[-1][0] = b
        else:
            rows.append([b, algo])
    if rows:
        rows[-1][0] = INF
    return {coll: {topology_class(single_node): rows}}
