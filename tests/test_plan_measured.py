"""The planner against real runs (slow: about 9 minutes on 2 cores): bench/plan_accuracy.py
on 10 layouts of 4 ranks and 10 of 8 (preset small), 3 interleaved runs each (the median),
--calibrate.

  * parameters per rank: the planner's count equals every rank's own parameters exactly;
  * memory: what stays allocated after two steps (tracemalloc) is at least the predicted
    params + grads + optimizer and at most that plus the buffers the model leaves out (see
    test_memory_model_against_measured); the peak of a step above it within 0.5x-2x of the
    predicted activations;
  * step time: Spearman's rho of predicted against measured beats the 95th percentile of rho
    for random permutations of the same predictions (a planner that ranks at random).
    bench/results/plan_accuracy.json (the same command, 2026-12-08, AMD EPYC VM): 4 ranks rho
    0.81 against a null p95 of 0.55, 8 ranks 0.98 against 0.54 (0.71 / 0.88 in the run before
    the review's mends). One run per layout was the
    protocol until then: single runs of one layout at 4 ranks differed by up to 1.5x (82 and
    121 ms in one benchmark), as much as the layouts' medians do, and the test failed on that noise as well
    as on the model (0.18 at 4 ranks, before the calibration's compute slowdown, arrival
    spread and bf16 peak: src/pympar/plan/cli.py's docstring).
"""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pympar.plan.cli import spearman, spearman_null_p95

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def accuracy(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plan")
    out = tmp / "acc.json"
    # --calibrate: the planner's constants from microbenchmarks (single process, allreduce at the
    # rank count) measured just before the layouts, never fitted to them
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "plan_accuracy.py"), "--world", "4,8", "--rounds", "3",
                        "--steps", "4", "--calibrate", "--timeout", "120", "--json", str(out), "--png", str(tmp / "a.png")],
                       timeout=1800, cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return json.loads(out.read_text())


def test_at_least_8_layouts_per_world_ran(accuracy):
    for w in (4, 8):
        ok = [r for r in accuracy["rows"] if r["world"] == w and r["status"] == "ok"]
        assert len(ok) >= 8, [r["layout"] for r in accuracy["rows"] if r["world"] == w and r["status"] != "ok"]


def test_params_per_rank_exact(accuracy):
    for r in accuracy["rows"]:
        if r["status"] == "ok":
            assert r["params_exact"], (r["layout"], r["params_predicted"], r["params_measured"])


def _omitted_bytes(r) -> float:
    """Upper bound of what outlives a step beyond the ledger's parameters + gradients (bucket
    buffers, ZeRO rows) + optimizer state: the collectives' buffers (the ledger's communication)
    and, with pp or tp, receive / gathered buffers: slices of one micro-batch's activations."""
    pp, tp = (int(re.search(rf"{k}(\d+)", r["layout"]).group(1)) for k in ("pp", "tp"))
    pm = r["predicted_memory"]
    out = float(pm["communication"])
    if pp > 1 or tp > 1:
        out += pm["activations"] / max(1, r["peak_in_flight"])
    return out


def test_memory_model_against_measured(accuracy):
    for r in accuracy["rows"]:
        if r["status"] != "ok":
            continue
        pm, mm = r["predicted_memory"], r["measured_memory"]
        counted = pm["parameters"] + pm["gradients"] + pm["optimizer"]
        # every byte the ledger counts as persistent exists on the worst rank (sizes exact,
        # params_exact; 5% for ZeRO's padding rows and the zero-2/3 transient it includes), so
        # tracemalloc cannot see much less; more is bounded by what _omitted_bytes lists.
        upper = counted + _omitted_bytes(r)
        assert 0.95 * counted <= mm["persistent"] <= upper, (r["layout"], mm, pm, upper)
        # the activation model is a count of saved tensors, not of the allocator's temporaries:
        # a factor-2 band either way (not derived from the model)
        assert 0.5 <= r["activation_ratio"] <= 2.0, (r["layout"], mm, pm)


def _mesh(r):
    return tuple(int(re.search(rf"{k}(\d+)", r["layout"]).group(1)) for k in ("dp", "pp", "tp"))


def test_zero1_saving_shows_in_what_the_process_holds(accuracy):
    """A ZeRO-1 rank holds less than the same mesh without ZeRO by (most of) the optimizer state
    it no longer keeps: the saving the ledger predicts is in the process (a bound loose enough to
    let a full-size copy of the state through would fail here, not pass the band above)."""
    ok = [r for r in accuracy["rows"] if r["status"] == "ok"]
    pairs = [(z0, z1) for z1 in ok if " zero1" in z1["layout"] for z0 in ok
             if " zero" not in z0["layout"] and _mesh(z0) == _mesh(z1) and z0["world"] == z1["world"]]
    assert pairs, "the layouts include a ZeRO-1 one and its mesh without ZeRO"
    for z0, z1 in pairs:
        saved = z0["predicted_memory"]["optimizer"] - z1["predicted_memory"]["optimizer"]
        got = z0["measured_memory"]["persistent"] - z1["measured_memory"]["persistent"]
        print(f"{z1['world']} ranks {z0['layout']} -> {z1['layout']}: the ledger saves {saved / 2**20:.2f} MiB, "
              f"the process holds {got / 2**20:.2f} MiB less")
        assert saved > 0 and got >= 0.8 * saved, (z0["layout"], z1["layout"], saved, got)


@pytest.mark.parametrize("world", [4, 8])
def test_ranking_beats_random_permutations(accuracy, world):
    ok = [r for r in accuracy["rows"] if r["world"] == world and r["status"] == "ok"]
    pred, meas = [r["predicted_s"] for r in ok], [r["measured_s"] for r in ok]
    rho, p95 = spearman(pred, meas), spearman_null_p95(pred, meas)
    print(f"{world} ranks: Spearman {rho:.2f}, null p95 {p95:.2f}")
    assert rho > p95, (world, rho, p95)
