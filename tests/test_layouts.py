"""The central claim under mpiexec: every layout dp x pp x tp (ep | dp) of world size 1, 2, 4 and 8
trains the single-process run (tests/mpi/mpi_layouts.py; the layouts in tests/mpi/layout_cases.py).

One launch per world size runs all its layouts. CI runs the all-pairs slice (``ci_layouts``); the
whole matrix is ``python -m pytest -m slow tests/test_layouts.py``. Each run checks that the launch
covered exactly the layouts enumerated here, and prints how many it ran and how long it took.
"""
import re
import sys
from pathlib import Path

import pytest

from mpirun import run_pytest_mpi

sys.path.insert(0, str(Path(__file__).parent / "mpi"))
from layout_cases import WORLDS, all_layouts, ci_layouts  # noqa: E402

pytestmark = pytest.mark.mpi


def _run(n, mode, timeout):
    res = run_pytest_mpi(n, "mpi_layouts.py", timeout=timeout, env={"PYMPAR_LAYOUTS": mode}, extra_args=("-s",))
    m = re.search(r"LAYOUTS world=(\d+) mode=(\w+) ran=(\d+) failed=(\d+) seconds=([\d.]+)(.*)", res.stdout)
    assert m, f"no LAYOUTS summary line in the output:\n{res.stdout[-3000:]}"
    print(m.group(0))
    return int(m.group(3)), int(m.group(4))


@pytest.mark.parametrize("n", WORLDS)
def test_ci_slice_of_layouts_matches_single_process(n):
    ran, failed = _run(n, "ci", timeout=150 if n == 8 else 90)
    assert (ran, failed) == (len(ci_layouts(n)), 0)


@pytest.mark.slow
@pytest.mark.parametrize("n", WORLDS)
def test_every_layout_matches_single_process(n):
    ran, failed = _run(n, "full", timeout=1200)
    assert (ran, failed) == (len(all_layouts(n)), 0)


def test_ci_slice_covers_every_pair_of_dimension_values():
    """The slice is representative: each pair of values of (shape, ep, model, schedule, sp, zero,
    dtype) that occurs in the full matrix occurs in the slice; every dimension value occurs."""
    from layout_cases import _pairs, all_layouts as full

    for n in WORLDS:
        want = set().union(*(_pairs(x) for x in full(n, dtypes=("float64", "float32"))))
        got = set().union(*(_pairs(x) for x in ci_layouts(n)))
        assert want == got, (n, sorted(want - got)[:5])
    assert len(all_layouts(8)) > 100 and {x.schedule for x in all_layouts(8)} == {"-", "gpipe", "1f1b", "interleaved"}
