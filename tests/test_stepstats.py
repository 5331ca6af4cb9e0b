"""The step's world vector (pympar.parallel.stepstats): a rank's StepShare packs itself by field
names and unpacks a vector of the same layout into the same shape, so the sum over ranks of the
packed shares unpacks into the sum of the shares, field by field."""
import numpy as np
import pytest

from pympar.parallel.stepstats import MoeShare, Slots, StepShare


def test_slots_place_each_name_once_and_read_back_what_was_put():
    s = Slots([("loss", 1), ("moe.0.load", 4), ("stage_times", 0), ("memory", 3)])
    assert s.size == 8
    v = s.zeros()
    s.put(v, "loss", 2.5)
    s.put(v, "moe.0.load", [1, 2, 3, 4])
    s.put(v, "memory", np.array([[7.0, 8.0, 9.0]]))
    s.get(v, "moe.0.load")[2] += 10                     # a view: a rank's own slot written in place
    assert v.tolist() == [2.5, 1, 2, 13, 4, 7, 8, 9]
    assert s.get(v, "stage_times").size == 0
    with pytest.raises(ValueError, match="slot 'loss' named twice"):
        Slots([("loss", 1), ("loss", 2)])


def _share(rank, world=3, E=4, ep=2):
    """Rank r's share as the runner writes one: its figures in its own places, zeros elsewhere."""
    sh = StepShare(loss=0.5 * rank, nonfinite=float(rank == 1), norm_sq=2.0 ** rank, stop=float(rank == 2),
                   written=1.0, moe={3: MoeShare.zeros(E, ep), 1: MoeShare.zeros(E, ep)},
                   stage_times=np.zeros((2, 3)), memory=np.zeros((2, world)))
    sh.moe[3].load[:] = np.arange(E) + 10 * rank
    sh.moe[1].rows[rank % ep] = 7 + rank
    sh.moe[1].a2a_s = 0.25
    sh.stage_times[rank % 2, :] = [rank + 1, rank + 2, rank + 3]
    sh.memory[:, rank] = (100 + rank, 200 + rank)
    return sh


def test_a_share_round_trips_through_its_vector():
    sh = _share(1)
    back = sh.unpack(sh.pack())
    assert back.loss == 0.5 and back.nonfinite == 1.0 and back.norm_sq == 2.0 and back.stop == 0.0
    assert sorted(back.moe) == [1, 3]
    np.testing.assert_array_equal(back.moe[3].load, sh.moe[3].load)
    np.testing.assert_array_equal(back.moe[1].rows, [0, 8])
    assert back.stage_times.shape == (2, 3) and back.memory.shape == (2, 3)
    np.testing.assert_array_equal(back.stage_times, sh.stage_times)
    np.testing.assert_array_equal(back.memory, sh.memory)
    # the vector is one float64 per value, in a layout every rank derives alike
    assert sh.pack().size == 5 + 2 * (4 + 2 + 3) + 6 + 6 == sh.slots().size


def test_the_sum_of_packed_shares_unpacks_to_the_sum_of_every_field():
    shares = [_share(r) for r in range(3)]
    total = shares[0].unpack(sum(s.pack() for s in shares))   # what the world allreduce returns
    assert total.loss == pytest.approx(1.5) and total.nonfinite == 1.0 and total.norm_sq == 7.0
    assert total.stop == 1.0 and total.written == 3.0
    np.testing.assert_array_equal(total.moe[3].load, 3 * np.arange(4) + 30)
    np.testing.assert_array_equal(total.moe[1].rows, [7 + 9, 8])
    assert total.moe[1].a2a_s == 0.75 and total.moe[3].a2a_s == 0.0
    np.testing.assert_array_equal(total.stage_times, [[1 + 3, 2 + 4, 3 + 5], [2, 3, 4]])
    np.testing.assert_array_equal(total.memory, [[100, 101, 102], [200, 201, 202]])
    # MoE layers travel by their number, not by insertion order: a rank that built its map in
    # another order packs the same layout
    other = _share(0)
    other.moe = {1: other.moe[1], 3: other.moe[3]}
    np.testing.assert_array_equal(other.pack(), shares[0].pack())


def test_a_vector_of_another_layout_is_refused():
    with pytest.raises(ValueError, match="a step vector of 3 values"):
        _share(0).unpack(np.zeros(3))


def test_moe_summary_reads_the_summed_layer():
    sh = MoeShare(load=np.array([3.0, 1.0]), rows=np.array([6.0, 2.0]), dropped=0.5, a2a_s=0.1, a2a_bytes=4096.0)
    st = sh.summary(layer=2, dpcp=2, ep=2)
    assert st["tokens_per_expert"] == [3, 1] and st["dropped_fraction"] == 0.25
    assert st["rows_per_ep_rank"] == [6, 2] and st["a2a_bytes"] == 4096 and st["rank_max_over_mean"] == 1.5
    assert "rows_per_ep_rank" not in sh.summary(layer=2, dpcp=2, ep=1)
