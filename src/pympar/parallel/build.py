"""This rank's part of a GPT on a layout, parallelised step by step: the one construction the
trainer and generation share.

``parallelize(cfg, mesh, layout)`` applies, in order, each dimension's step (torchtitan's
``apply_*`` shape), each in its dimension's module:

    tp   tp.apply_tp         the parts the model is made of: tp.TPParts over the mesh's tp group (the
                             experts over their own groups when folded apart from tp, etp < tp), or
                             pympar.nn's (tp = 1)
    pp   pp.apply_pp         pp > 1: this rank's stages of those parts (pp.PipelineGPT), placed as the
                             layout's schedule places them; else one nn.GPT (tp.TPGPT: the same class
                             body made of TPParts)
    ep   ep.install_expert_parallel       ep > 1: every MoE layer keeps this ep rank's experts
    cp   cp.install_context_parallel      cp > 1: ring or Ulysses attention over this rank's positions
    ac   nn.gpt.set_recompute             activation recomputation of every block

Each step marks the parameters it shards or splits (parallel/placement.py); the gradient path
reads those marks (parallel/gradsync.py). Parameters are made on first use (nn.init), so a rank
allocates only its own pieces; restore a checkpoint into the result, or train it from (config,
seed). ZeRO and the gradient path are the trainer's (pympar.parallel.runner), and so is the
pipeline's executor.
"""
from __future__ import annotations

import numpy as np

from ..nn.gpt import GPT, set_recompute
from .meter import Meter


def parallelize(cfg, mesh, layout, *, seed: int = 0, dtype=np.float32, compute_dtype=None,
                sequence_parallel: bool = False, meter: Meter | None = None, ep_dispatch: str = "flat"):
    """The model of this rank of ``mesh`` (a pympar.parallel.mesh.Mesh) for ``layout`` (a
    pympar.layout.Layout that passed pympar.layout.check: its pp, virtual stages, schedule, cp
    attention and recomputation are used; the mesh gives the groups). dtype / compute_dtype: master
    and compute precision (nn.GPT's); sequence_parallel: TPGPT's; meter: where the tp collectives,
    the cp attentions and the expert all-to-alls report their seconds (pympar.parallel.meter);
    ep_dispatch: the experts' token exchange (parallel.ep.node_route)."""
    # each dimension's step is imported where the layout uses it
    parts = None
    if mesh.tp > 1:
        from .tp import apply_tp
        parts = apply_tp(mesh, dtype=dtype, compute_dtype=compute_dtype, sequence_parallel=sequence_parallel,
                         meter=meter)
    if layout.pp > 1:
        from .pp import apply_pp
        model = apply_pp(cfg, parts, mesh, layout, seed=seed, dtype=dtype, compute_dtype=compute_dtype)
    elif parts is not None:
        from .tp import TPGPT
        model = TPGPT(cfg, seed=seed, parts=parts)
    else:
        model = GPT(cfg, seed=seed, dtype=dtype, compute_dtype=compute_dtype)
    if mesh.ep > 1:                      # keep n_expert/ep experts; tokens move by alltoallv
        from .ep import install_expert_parallel
        install_expert_parallel(model, mesh.ep_comm, meter, dispatch=ep_dispatch)
    if mesh.cp > 1:                      # this rank's positions; K, V travel over the cp group
        from .cp import install_context_parallel
        install_context_parallel(model, mesh.cp_comm, cfg.block_size, meter, comm=layout.cp_comm, a2a=layout.cp_a2a)
    set_recompute(model, layout.recompute)
    return model
