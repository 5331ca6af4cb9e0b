"""Mesh groups for every valid layout (dp, pp, cp, tp, ep, etp: the experts folded apart or not) of this world
size, and the error for invalid ones."""
import numpy as np
import pytest

from pympar.comm import MPIComm
from pympar.parallel.mesh import Mesh


def layouts(world):
    for cp in range(1, world + 1):
        for tp in range(1, world + 1):
            for pp in range(1, world + 1):
                if world % (tp * pp * cp) == 0:
                    dp = world // (tp * pp * cp)
                    for etp in (e for e in range(1, tp + 1) if tp % e == 0):
                        reach = dp * cp * tp // etp
                        for ep in (e for e in range(1, reach + 1) if reach % e == 0):
                            yield dict(dp=dp, pp=pp, tp=tp, ep=ep, cp=cp, etp=etp)


@pytest.fixture(scope="module")
def comm(mpi_world):
    return MPIComm(mpi_world, name="w", timeout=60)



def test_every_valid_layout(comm):
    n, r = comm.size, comm.rank
    for lay in layouts(n):
        m = Mesh(comm, **lay)
        want = Mesh.groups(n, **lay)
        me = np.array([r])
        for kind in ("tp", "dp", "pp", "cp", "dpcp", "ep", "edp", "etp", "fold"):
            sub = getattr(m, f"{kind}_comm")
            got = sub.allgather(me, algo="mpi").tolist()
            assert got in want[kind], f"{lay} {kind}: {got} not in {want[kind]}"
            assert r in got and got.index(r) == sub.rank
        assert (m.pp_rank, m.dp_rank, m.cp_rank, m.tp_rank) == Mesh.coords(r, lay["dp"], lay["pp"], lay["tp"], lay["cp"])
        fold = lay["tp"] // lay["etp"]
        assert m.tp_comm.size == lay["tp"] and m.edp_comm.size == lay["dp"] * lay["cp"] * fold // lay["ep"]
        assert m.fold_comm.size == fold and m.fold_rank == m.fold_comm.rank and m.etp_rank == m.etp_comm.rank
        assert m.ep_rank == m.ep_comm.rank and m.edp_rank == m.edp_comm.rank
        # the experts' grid covers the stage: etp x ep x edp = dp*cp*tp, one rank per coordinate
        cell = np.array([m.etp_rank, m.ep_rank, m.edp_rank, m.pp_rank])
        cells = {tuple(c) for c in comm.allgather(cell, algo="mpi").reshape(n, 4).tolist()}
        assert len(cells) == n
        block = lay["dp"] * lay["cp"] * lay["tp"]
        assert m.prev_stage == (r - block if m.pp_rank > 0 else None)
        assert m.next_stage == (r + block if m.pp_rank < lay["pp"] - 1 else None)
        # tensor-parallel ranks are adjacent, pipeline stages are contiguous blocks
        tpg = m.tp_comm.allgather(me, algo="mpi").tolist()
        assert tpg == list(range(tpg[0], tpg[0] + lay["tp"]))
        assert m.pp_rank == r // block
        for c in m.communicators():
            if c is not comm and hasattr(c, "free"):
                c.free()


def test_invalid_layouts_raise_before_any_collective(comm):
    n = comm.size
    for bad, msg in [(dict(dp=n + 1), "world size"), (dict(dp=n, ep=n + 1), "does not divide"),
                     (dict(dp=n, tp=0), "positive integer"), (dict(dp=1, tp=n, etp=n + 1), "etp=.* does not divide tp"),
                     (dict(dp=1, tp=n, ep=2 * n, etp=1), "ep=.* does not divide")]:
        with pytest.raises(ValueError, match=msg):
            Mesh(comm, **bad)
    comm.barrier()  # every rank raised and is still in step
