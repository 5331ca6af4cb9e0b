"""Mesh validation without MPI, and its groups under mpiexec for every layout up to 8 ranks."""
import pytest

from mpirun import run_pytest_mpi
from pympar.parallel.mesh import Mesh


def test_validate_messages():
    with pytest.raises(ValueError, match=r"world size 8 != dp\*pp\*tp = 3\*1\*1 = 3"):
        Mesh.validate(8, dp=3)
    with pytest.raises(ValueError, match="ep=3 does not divide dp=4"):
        Mesh.validate(8, dp=4, tp=2, ep=3)
    Mesh.validate(8, dp=2, pp=2, tp=2, ep=2)


def test_layout_tp_adjacent_pp_contiguous():
    g = Mesh.groups(8, dp=2, pp=2, tp=2, ep=2)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["ep"] == g["dp"] and g["edp"] == [[r] for r in (0, 2, 1, 3, 4, 6, 5, 7)]
    g = Mesh.groups(4, dp=4, ep=2)
    assert g["ep"] == [[0, 1], [2, 3]] and g["edp"] == [[0, 2], [1, 3]]


def test_folded_expert_grid():
    """ep over tp ranks (etp < tp): the issue's example, 8 ranks as tp 2 x dp 4 for attention and ep 8,
    etp 1 for the experts, and its ep 4 variant; unfolded (etp = tp) is the older rule."""
    g = Mesh.groups(8, dp=4, tp=2, ep=8, etp=1)
    assert g["ep"] == [list(range(8))] and g["edp"] == [[r] for r in range(8)]
    assert g["fold"] == g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]] and g["etp"] == [[r] for r in range(8)]
    g = Mesh.groups(8, dp=4, tp=2, ep=4, etp=1)
    assert g["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]] and g["edp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    g = Mesh.groups(8, dp=2, tp=4, ep=2, etp=2)
    assert g["etp"] == [[0, 1], [2, 3], [4, 5], [6, 7]] and sorted(g["ep"]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert sorted(g["fold"]) == [[0, 2], [1, 3], [4, 6], [5, 7]] and sorted(g["edp"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert Mesh.groups(8, dp=4, tp=2, ep=2) == Mesh.groups(8, dp=4, tp=2, ep=2, etp=2)
    with pytest.raises(ValueError, match=r"ep=8 does not divide dp=4.*--etp 1"):
        Mesh.validate(8, dp=4, tp=2, ep=8)
    with pytest.raises(ValueError, match="etp=3 does not divide tp=2"):
        Mesh.validate(8, dp=4, tp=2, etp=3)


def test_size_one_mesh_uses_selfcomm():
    m = Mesh(None)
    assert m.tp_comm.size == m.dp_comm.size == 1 and m.prev_stage is None and m.next_stage is None


@pytest.mark.mpi
@pytest.mark.parametrize("n", [1, 2, 3, 4, pytest.param(6, marks=pytest.mark.slow), 8])
def test_mesh_groups_under_mpi(n):
    run_pytest_mpi(n, "mpi_mesh.py", timeout=150)
