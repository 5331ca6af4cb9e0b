"""parallel/overlap.py: two strands (greenlets on the caller's thread), one running at a time, control
passing only at exchanges."""
import threading
import time

import pytest

from pympar.nn.wgrad import WeightGrads, deferrable, deferring
from pympar.parallel import overlap


class Req:
    """A started exchange: wait() logs and returns its value."""

    def __init__(self, log, name, value):
        self.log, self.name, self.value = log, name, value

    def wait(self):
        self.log.append(f"wait {self.name}")
        return self.value


def strand(log, name, n):
    def run():
        got = []
        for i in range(n):
            log.append(f"{name} computes {i}")
            tag = f"{name}{i}"
            out, secs = overlap.exchange(lambda: log.append(f"blocking {tag}") or tag,
                                         lambda: log.append(f"start {tag}") or Req(log, tag, tag))
            assert secs >= 0
            got.append(out)
        log.append(f"{name} ends")
        return got
    return run


def test_control_passes_at_each_exchange_and_the_longer_strand_finishes_blocking():
    log = []
    fa, fb, sa, sb = overlap.interleave(strand(log, "F", 2), strand(log, "B", 3))
    assert fa == ["F0", "F1"] and fb == ["B0", "B1", "B2"]
    assert log == ["F computes 0", "start F0",            # F starts its exchange, B runs meanwhile
                   "B computes 0", "start B0",
                   "wait F0", "F computes 1", "start F1",
                   "wait B0", "B computes 1", "start B1",
                   "wait F1", "F ends",                   # F done: B's last exchange blocks
                   "wait B1", "B computes 2", "blocking B2", "B ends"]
    assert sa >= 0 and sb >= 0


def test_outside_a_pair_the_exchange_is_the_blocking_call():
    log = []
    assert not overlap.active()
    assert strand(log, "X", 2)() == ["X0", "X1"]
    assert log == ["X computes 0", "blocking X0", "X computes 1", "blocking X1", "X ends"]


def test_each_strand_counts_its_own_seconds():
    def sleeper(t):
        def run():
            time.sleep(t)
            overlap.exchange(lambda: None, lambda: Req([], "x", None))
            time.sleep(t)
        return run
    _, _, sa, sb = overlap.interleave(sleeper(0.01), sleeper(0.1))
    assert 0.019 <= sa < 0.5 * sb, (sa, sb)   # a's 2 x 10 ms, without b's 2 x 100 ms
    assert 0.19 <= sb, sb


def test_turns_are_reported_where_they_ran():
    log, turns = [], []
    _, _, sa, sb = overlap.interleave(strand(log, "F", 2), strand(log, "B", 3),
                                      on_turn=lambda k, t, dt: turns.append((k, t, dt)))
    # F's turns end at its exchanges F0 and F1 and at its end; B's at B0, B1 and its end (B2 blocks)
    assert [k for k, _, _ in turns] == [0, 1, 0, 1, 0, 1]
    assert all(dt >= 0 for _, _, dt in turns)
    assert all(t0 + dt <= t1 for (_, t0, dt), (_, t1, _) in zip(turns, turns[1:]))   # one after another
    assert sum(dt for k, _, dt in turns if k == 0) == pytest.approx(sa, abs=1e-12)
    assert sum(dt for k, _, dt in turns if k == 1) == pytest.approx(sb, abs=1e-12)


def test_clock_leaves_out_the_partners_turns():
    # a strand times a stretch with an exchange in it (as the node-aware route's meter does): the
    # partner's 100 ms run during the exchange is not the strand's; outside a pair it is perf_counter
    got = {}

    def timed():
        t0 = overlap.clock()
        time.sleep(0.01)
        overlap.exchange(lambda: None, lambda: Req([], "x", None))
        time.sleep(0.01)
        got["a"] = overlap.clock() - t0

    def partner():
        time.sleep(0.1)
        overlap.exchange(lambda: None, lambda: Req([], "y", None))
    overlap.interleave(timed, partner)
    assert 0.019 <= got["a"] < 0.06, got
    t0, p0 = overlap.clock(), time.perf_counter()
    assert abs(t0 - p0) < 0.01


def test_an_error_in_either_strand_is_raised_after_both_ended():
    log = []

    def bad():
        overlap.exchange(lambda: None, lambda: Req(log, "bad", None))
        raise KeyError("boom")
    with pytest.raises(KeyError):
        overlap.interleave(bad, strand(log, "B", 2))
    assert log[-1] == "B ends" and not overlap.active()
    with pytest.raises(KeyError):
        overlap.interleave(strand(log, "F", 1), bad)
    assert not overlap.active()


def test_both_strands_run_on_the_callers_thread():
    ids = []

    def who():
        ids.append(threading.get_ident())
        overlap.exchange(lambda: None, lambda: Req([], "x", None))
        ids.append(threading.get_ident())
    overlap.interleave(who, who)
    assert ids == [threading.get_ident()] * 4


def test_a_strand_cannot_start_another_pair():
    with pytest.raises(RuntimeError, match="cannot start another pair"):
        overlap.interleave(lambda: overlap.interleave(lambda: 0, lambda: 0), lambda: 0)


def test_a_backwards_deferred_weight_gradients_stay_in_its_strand():
    seen, ran = [], []

    def backward():
        with WeightGrads() as w:
            overlap.exchange(lambda: None, lambda: Req([], "b", None))
            deferrable(lambda: ran.append("w"))
        assert ran == []
        w.run()
        return ran

    def forward():
        seen.append(deferring())           # while the backward's scope is open in the other strand
        overlap.exchange(lambda: None, lambda: Req([], "f", None))
        seen.append(deferring())

    overlap.interleave(forward, backward)
    assert seen == [False, False] and ran == ["w"]


class Counting(Req):
    """A started exchange that counts its tests (done after ``after`` of them; never when None)."""

    def __init__(self, after=None):
        super().__init__([], "c", None)
        self.tests, self.after = 0, after

    def nudge(self):
        self.tests += 1
        return self.after is not None and self.tests >= self.after


def test_the_partners_products_progress_the_exchange_in_flight():
    """While one strand's exchange is in flight, each product the other strand computes tests it
    (comm.progress.poke in nn.products.matmul); once the strand resumes, nothing tests it any more."""
    import numpy as np

    from pympar.nn.products import matmul

    req = Counting()
    a = np.ones((8, 8), np.float32)

    def first():
        overlap.exchange(lambda: None, lambda: req)
        return req.tests

    def second():
        for _ in range(3):
            matmul(a, a)
        return req.tests

    at_resume, during = overlap.interleave(first, second)[:2]
    assert during == 3 and at_resume == 3
    matmul(a, a)
    assert req.tests == 3


def test_a_poked_request_that_completes_is_tested_no_more():
    from pympar.comm import progress

    req = Counting(after=2)
    progress.behind(req)
    for _ in range(4):
        progress.poke()
    assert req.tests == 2
    progress.forget(req)                       # (already gone: forgetting it again is harmless)


def test_a_blocks_forward_and_backward_poke_between_their_pieces():
    """A dense block's forward and backward test the request in flight behind them at their seams
    (the products and the block's pieces), not only once."""
    import numpy as np

    from pympar.comm import progress
    from pympar.nn import GPT, GPTConfig

    m = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8), seed=0)
    x = np.zeros((1, 8, 8), np.float32)
    req = Counting()
    progress.behind(req)
    try:
        y, ctx = m.h[0].forward(x)
        fwd = req.tests
        m.h[0].backward(np.ones_like(y), ctx)
    finally:
        progress.forget(req)
    assert fwd >= 2 and req.tests >= fwd + 2, (fwd, req.tests)
