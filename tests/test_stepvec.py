"""The step vector's named slots (pympar.parallel.stepvec): each name one place, read back as written."""
import numpy as np
import pytest

from pympar.parallel.stepvec import Slots


def test_slots_place_each_name_once_and_read_back_what_was_put():
    s = Slots([("loss", 1), ("moe0.load", 4), ("stage_times", 0), ("memory", 3)])
    assert s.size == 8
    v = s.zeros()
    s.put(v, "loss", 2.5)
    s.put(v, "moe0.load", [1, 2, 3, 4])
    s.put(v, "memory", np.array([[7.0, 8.0, 9.0]]))
    s.get(v, "moe0.load")[2] += 10                     # a view: a rank's own slot written in place
    assert v.tolist() == [2.5, 1, 2, 13, 4, 7, 8, 9]
    assert s.scalar(v, "loss") == 2.5 and s.get(v, "stage_times").size == 0
    with pytest.raises(ValueError, match="slot 'loss' named twice"):
        Slots([("loss", 1), ("loss", 2)])
