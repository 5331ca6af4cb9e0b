"""Replicated hot experts: the placement rule (parallel/replicas.py) in this process, and the
layer under mpiexec (tests/mpi/mpi_ep_replicas.py)."""
import numpy as np
import pytest

from mpirun import run_pytest_mpi
from pympar.parallel.replicas import max_over_mean, place_replicas, rank_loads, split, valid_copies


def zipf(E, s=1.2):
    return np.round(1e4 / np.arange(1, E + 1) ** s)


def test_placement_rules():
    loads = zipf(16)
    copies = place_replicas(loads, 4, 2)
    assert copies == place_replicas(list(loads), 4, 2)                      # a function of the counts alone
    assert [c[0] for c in copies] == [e // 4 for e in range(16)]            # home first
    assert all(len(set(c)) == len(c) for c in copies)                        # one copy per rank at most
    per_rank = np.bincount([r for c in copies for r in c[1:]], minlength=4)
    assert per_rank.tolist() == [2, 2, 2, 2]                                 # every slot used, none twice
    assert len(copies[0]) > 1                                                # the hottest expert is replicated
    # Zipf loads on the home placement put the hottest experts on rank 0; replicas even it out
    before = max_over_mean(rank_loads(loads, [[e // 4] for e in range(16)], 4))
    after = [max_over_mean(rank_loads(loads, place_replicas(loads, 4, s), 4)) for s in (1, 2, 3)]
    assert before > 2.7 and after[0] < 1.6 and after[1] < 1.25 and after[2] < 1.07


def test_placement_refuses_what_cannot_be_held():
    with pytest.raises(ValueError, match="do not divide"):
        place_replicas(np.ones(6), 4, 1)
    with pytest.raises(ValueError, match="replica slots per rank"):
        place_replicas(np.ones(8), 4, 7)                                     # 6 other experts at most
    assert place_replicas(np.ones(8), 4, 0) == [[e // 2] for e in range(8)]


def test_a_checkpoints_placement_is_checked_before_use():
    good = place_replicas(zipf(8), 4, 1)
    assert valid_copies(good, 8, 4, 1) and valid_copies([[e // 2] for e in range(8)], 8, 4, 1)
    assert not valid_copies(good, 8, 2, 1)                                   # another ep: the homes differ
    assert not valid_copies(place_replicas(zipf(8), 4, 2), 8, 4, 1)         # more slots than this run has
    assert not valid_copies([[0, 0]] + good[1:], 8, 4, 1)                   # a rank holding two copies
    assert not valid_copies([[0, 9]] + good[1:], 8, 4, 1)                   # no such rank
    assert not valid_copies(good[:7], 8, 4, 1) and not valid_copies("x", 8, 4, 1)


def test_split_is_even_and_covers_every_row():
    for n in (0, 1, 7, 10):
        for k in (1, 2, 3):
            parts = split(n, k)
            assert parts[0][0] == 0 and parts[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
            assert max(b - a for a, b in parts) - min(b - a for a, b in parts) <= 1


@pytest.mark.mpi
def test_replicas_under_mpi():
    run_pytest_mpi(4, "mpi_ep_replicas.py", timeout=120)
