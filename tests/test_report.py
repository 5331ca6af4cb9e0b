"""pympar.report: the PNGs a run directory allows, from hand-made metrics and trace files."""
import json
import os

import numpy as np
import pytest

from pympar import report
from pympar.profile import Recorder, write_chrome_trace


def _metrics(path, moe):
    with open(path, "w") as f:
        for s in range(6):
            rec = {"step": s, "loss": 5.5 - 0.1 * s, "val_loss": 5.4 - 0.1 * s if s % 3 == 2 else None,
                   "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1000.0 + s, "mfu": 0.05, "step_time": 0.02,
                   "time_split": {"compute": 0.015, "dp_comm": 0.003, "optimizer": 0.001}, "loss_scale": 1.0,
                   "moe": [{"layer": i, "tokens_per_expert": [10, 20, 30, 40], "load_cv": 0.4,
                            "max_over_mean": 1.6, "dropped_fraction": 0.0} for i in range(2)] if moe else []}
            f.write(json.dumps(rec) + "\n")


def _trace(path, ranks=3):
    events = []
    for r in range(ranks):
        rec = Recorder(enabled=True)
        rec.origin = 0.0
        for step in range(2):
            t = step * 1.0
            rec.add(f"step {step}", "step", t, 0.9)
            rec.add("micro-batch 0", "compute", t, 0.5)
            rec.add("fwd h.0", "layer", t, 0.2, mb=0)
            rec.add("allreduce grads", "dp_comm", t + 0.5, 0.3, bytes=1024)
            rec.add("optimizer", "optimizer", t + 0.8, 0.1)
        events.append(rec.events)
    write_chrome_trace(path, events)


@pytest.mark.parametrize("moe, trace", [(False, False), (True, True)])
def test_report_writes_what_the_run_allows(tmp_path, moe, trace):
    _metrics(tmp_path / "metrics.jsonl", moe)
    if trace:
        _trace(tmp_path / "trace.json")
    wrote = {p.name for p in report.make_report(tmp_path)}
    want = {"loss.png", "throughput.png", "time_split.png"} | ({"experts.png"} if moe else set()) \
        | ({"pipeline.png"} if trace else set())
    assert wrote == want
    for name in want:
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000


def test_chrome_trace_rows_and_units(tmp_path):
    _trace(tmp_path / "t.json", ranks=2)
    ev = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert [e["args"]["name"] for e in ev if e["name"] == "process_name"] == ["rank 0", "rank 1"]
    ar = [e for e in ev if e["name"] == "allreduce grads" and e["pid"] == 1]
    assert ar[1]["ts"] == pytest.approx(1.5e6) and ar[1]["dur"] == pytest.approx(0.3e6)   # microseconds
    compute = [e for e in ev if e["name"] == "micro-batch 0" and e["pid"] == 1]
    assert ar[0]["args"] == {"bytes": 1024} and ar[0]["tid"] != compute[0]["tid"]   # own thread row


def test_recorder_totals_are_per_category_and_reset():
    rec = Recorder(enabled=False)
    rec.add("a", "compute", 0.0, 0.25)
    rec.add("b", "compute", 0.0, 0.5)
    rec.add("c", "dp_comm", 0.0, 0.125)
    rec.add("d", "layer", 0.0, 9.0)               # nested detail: not part of the split
    t = rec.take_totals()
    assert t["compute"] == 0.75 and t["dp_comm"] == 0.125 and sum(t.values()) == 0.875
    assert sum(rec.take_totals().values()) == 0 and rec.events == []


def test_report_cli_errors_without_metrics(tmp_path, capsys):
    assert report.main([str(tmp_path)]) == 2
    assert "no metrics file" in capsys.readouterr().err
    m = tmp_path / "metrics.jsonl"
    row = '{"step": 0, "loss": 1.0, "tokens_per_s": 1.0, "time_split": {}}\n'
    m.write_text(row + '{"step": 1, "lo')                             # the last line cut short by a kill
    assert [r["step"] for r in report.read_metrics(m)] == [0]
    assert "line 2 is cut short (a killed run?): left out" in capsys.readouterr().err
    m.write_text(row + '{"step": 1, "lo\n' + row)                   # damaged inside
    assert report.main([str(tmp_path)]) == 2
    assert f"{m}: line 2 is not JSON" in capsys.readouterr().err
    m.unlink()
    m.mkdir()                                                          # a directory where the file goes
    assert report.main([str(tmp_path)]) == 2
    assert f"{m}: Is a directory" in capsys.readouterr().err


def test_expert_heat_map_over_training_and_the_per_rank_view(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pympar.report import expert_series, plot_experts

    m = [dict(step=s, moe=[dict(layer=0, tokens_per_expert=[s, 10, 10, 20 - s], dropped_fraction=0.01 * s),
                           dict(layer=1, tokens_per_expert=[5, 5, 5, 5], dropped_fraction=0.0)]) for s in range(10)]
    ser = expert_series(m)
    steps, share, dropped = ser[0]
    assert steps.tolist() == list(range(10)) and share.shape == (10, 4)
    np.testing.assert_allclose(share.sum(axis=1), 1.0)
    np.testing.assert_allclose(share[:, 0], np.arange(10) / 40)        # this step's share, not the run's
    np.testing.assert_allclose(dropped, 0.01 * np.arange(10))
    np.testing.assert_allclose(ser[1][1], 0.25)
    heights = {}
    for ep in (1, 2):
        d = tmp_path / f"ep{ep}"
        d.mkdir()
        assert plot_experts(m, d, plt, ep=ep)
        from PIL import Image
        heights[ep] = Image.open(d / "experts.png").size[1]
    assert heights[2] > heights[1]                # the per-rank row is drawn only with expert parallelism
    assert not plot_experts([dict(step=0, moe=[])], tmp_path, plt)


def test_rank_rows_are_the_rows_each_rank_ran_where_recorded():
    """With replicas the rows each ep rank ran (rows_per_ep_rank) are the ranks' load, not their
    home experts' share: the per-rank row reads them, layers averaged, each step's own shares."""
    from pympar.report import _rows_per_rank

    m = [dict(step=s, moe=[dict(layer=0, tokens_per_expert=[9, 1, 1, 1], rows_per_ep_rank=[6, 6]),
                           dict(layer=1, tokens_per_expert=[9, 1, 1, 1], rows_per_ep_rank=[3, 9])]) for s in range(3)]
    np.testing.assert_allclose(_rows_per_rank(m, 2), [[0.375, 0.625]] * 3)
    assert _rows_per_rank([dict(step=0, moe=[dict(layer=0, tokens_per_expert=[1, 1])])], 2) is None


@pytest.mark.parametrize("record", [
    '{"step": 0, "loss": 1.0}',                                                          # fields missing
    '{"step": 0, "loss": 1.0, "tokens_per_s": 1.0, "mfu": null, "step_time": 0.1, "time_split": {}}',
    '{"step": 0, "loss": 1.0, "tokens_per_s": 1.0, "mfu": 0.1, "step_time": 0.1, "time_split": [1]}',
    '{"step": 0, "loss": 1.0, "tokens_per_s": 1.0, "mfu": 0.1, "step_time": 0.1, "time_split": {}, "moe": [1]}',
], ids=["missing", "null-mfu", "list-split", "moe-list"])
def test_report_refuses_records_that_are_not_the_trainers_in_one_line(tmp_path, capsys, record):
    """A metrics.jsonl of well-formed records with foreign fields: one error line naming the file and exit
    2 (before: KeyError/TypeError/AttributeError tracebacks); a trace.json of foreign events the same."""
    (tmp_path / "metrics.jsonl").write_text(record + "\n")
    assert report.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"pympar.report: error: {tmp_path / 'metrics.jsonl'}: not what pympar.train writes" in err, err


def test_report_refuses_a_foreign_trace_in_one_line(tmp_path, capsys):
    good = '{"step": 0, "loss": 1.0, "tokens_per_s": 1.0, "mfu": 0.1, "step_time": 0.1, "time_split": {}}\n'
    (tmp_path / "metrics.jsonl").write_text(good)
    for events in ('[1]', '[{"cat": "step", "pid": 0}]'):
        (tmp_path / "trace.json").write_text('{"traceEvents": %s}' % events)
        assert report.main([str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert f"pympar.report: error: {tmp_path / 'trace.json'}: not what pympar.train writes" in err, err
    (tmp_path / "trace.json").unlink()
    os.mkfifo(tmp_path / "trace.json")                # a pipe is never opened (it would wait for a writer)
    assert report.main([str(tmp_path)]) == 2
    assert "trace.json: not a Chrome trace of pympar.train (ValueError('not a regular file'))" in capsys.readouterr().err
