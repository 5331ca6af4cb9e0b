"""Each parameter's placement is set by the step that makes it so (parallel/placement.py), and what
reads it -- the tp and tied sums, the gradients final only after them, the reduction group -- gets
the parameters the model's own declarations name. Construction only: no MPI."""
import numpy as np
import pytest

from pympar.nn import GPTConfig
from pympar.parallel.ep import install_expert_parallel
from pympar.parallel.placement import Placement, param_placement, partial_over
from pympar.parallel.pp import PipelineGPT
from pympar.parallel.tp import TPGPT, TPParts

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32, bias=True)
MOE = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, bias=True, n_expert=4, top_k=2)


def is_expert_param(name):
    """The experts by their names (the oracle: the library places them by the module that holds them)."""
    return ".moe.experts." in name


class FakeComm:
    """A rank of a group of ``size``: construction only asks for rank and size."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size


def declared_sp_partials(model):
    """What the TP layers declare (each layer's sp_partial_params), independently of placements."""
    out = list(model.embedding.sp_partial_params())
    for b in model.h:
        out += b.sp_partial_params()
    return out + model.head.sp_partial_params()


@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallelism_places_shards_and_sequence_parallel_partials(sp):
    model = TPGPT(CFG, FakeComm(1, 2), seed=0, sequence_parallel=sp)
    want = {id(p) for p in declared_sp_partials(model)}
    assert bool(want) == sp                      # the layers declare partials only under sp
    for n, p in model.named_parameters():
        pl = param_placement(p)
        assert pl.tp == ("shard" if p.shard is not None else "replicate"), n
        assert pl.partial == (("tp",) if id(p) in want else ()), n
        assert pl.group == "dp" and not pl.tied_copy, n
    assert {id(p) for p in model.sp_partial_params()} == want
    assert set(model.later_grad_ids()) == want   # final only after the tp sum
    if sp:                                       # LayerNorms, wpe, row-parallel biases; never a shard
        names = {n for n, p in model.named_parameters() if id(p) in want}
        assert "transformer.wpe.weight" in names and "transformer.ln_f.weight" in names
        assert all(model_p.shard is None for model_p in model.sp_partial_params())


@pytest.mark.parametrize("rank, first, last", [(0, True, False), (1, False, True)])
def test_the_pipeline_places_the_tied_weight_partial_over_its_ends(rank, first, last):
    model = PipelineGPT(CFG, 0, pp=2, rank=rank)
    assert (model.is_first, model.is_last) == (first, last)
    tied = model.tied_weight
    assert param_placement(tied) == Placement(partial=("pp",), tied_copy=last)
    assert partial_over(model.parameters(), "pp") == [tied]
    assert set(model.later_grad_ids()) == {id(tied)}
    others = [p for p in model.parameters() if p is not tied]
    assert others and all(param_placement(p) == Placement() for p in others)


def test_the_v_placement_keeps_one_wte_with_no_partial():
    """zb-v's V: stage 0 and the last stage on rank 0, one wte: nothing to sum, no copy."""
    model = PipelineGPT(CFG, 0, pp=2, rank=0, v=2, placement="v")
    assert model.is_first and model.is_last
    assert param_placement(model.tied_weight) == Placement()
    assert not partial_over(model.parameters(), "pp") and not model.later_grad_ids()


def test_tensor_parallel_stages_place_their_partials():
    model = PipelineGPT(CFG, 0, pp=2, rank=1, factory=TPParts(FakeComm(0, 2), sequence_parallel=True))
    parts = model.sp_partial_params()
    assert parts and all(param_placement(p).partial == ("tp",) for p in parts)
    assert set(model.later_grad_ids()) == {id(p) for p in parts} | {id(model.tied_weight)}


def test_expert_parallelism_puts_its_experts_in_the_edp_group():
    from pympar.nn import GPT

    model = install_expert_parallel(GPT(MOE, seed=0), FakeComm(1, 2))
    named = list(model.named_parameters())
    assert any(is_expert_param(n) for n, _ in named)
    for n, p in named:
        assert param_placement(p).group == ("edp" if is_expert_param(n) else "dp"), n


def test_folded_experts_are_placed_in_the_edp_group_unfolded_ones_are_not():
    folded = TPGPT(MOE, FakeComm(0, 2), seed=0, etp_comm=FakeComm(0, 1), fold_comm=FakeComm(0, 2))
    unfolded = TPGPT(MOE, FakeComm(0, 2), seed=0)
    for model, group in ((folded, "edp"), (unfolded, "dp")):
        for n, p in model.named_parameters():
            assert param_placement(p).group == (group if is_expert_param(n) else "dp"), n
    assert np.sum([is_expert_param(n) for n, _ in folded.named_parameters()]) > 0
