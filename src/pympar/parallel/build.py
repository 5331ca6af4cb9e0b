"""This rank's part of a GPT on a layout: the one construction the trainer and generation share.

    pp = 1, tp = 1    nn.GPT
    pp = 1, tp > 1    TPGPT over the mesh's tp group
    pp > 1            PipelineGPT: this rank's chunks (made of tp.TPParts when tp > 1), placed as
                      the layout's schedule places them (the V of zb-v, else interleaved)
    ep > 1            every MoE layer keeps this ep rank's experts (install_expert_parallel)
    etp < tp          the experts folded apart from the tp group (parallel.mesh, parallel.tp.moe):
                      split over the mesh's etp group, the tp group's rows shared over its fold group

Parameters are made on first use (nn.init), so a rank allocates only its own pieces; restore a
checkpoint into the result, or train it from (config, seed). Context parallelism, the gradient
path and the pipeline executor are the trainer's (pympar.parallel.runner).
"""
from __future__ import annotations

import numpy as np

from .ep import install_expert_parallel
from .meter import Meter


def build_model(cfg, mesh, layout, *, seed: int = 0, dtype=np.float32, compute_dtype=None,
                sequence_parallel: bool = False, meter: Meter | None = None, ep_dispatch: str = "flat"):
    """The model of this rank of ``mesh`` (a pympar.parallel.mesh.Mesh of the layout's dp, pp, tp,
    ep) for ``layout`` (a pympar.layout.Layout that passed pympar.layout.check: its pp, tp, ep,
    virtual stages and schedule are used). dtype / compute_dtype: master and compute precision
    (nn.GPT's); sequence_parallel: TPGPT's; meter: where the tp collectives and the expert
    all-to-alls report their seconds (pympar.parallel.meter); ep_dispatch: the experts' token exchange
    (parallel.ep.node_route)."""
    parts = None
    if layout.tp > 1:
        from .tp import TPCollectives, TPParts
        tpc = TPCollectives(mesh.tp_comm, meter=meter)         # one for every chunk: one meter
        etpc = foldc = None
        if mesh.fold > 1:                                      # folded: the experts' own groups
            etpc, foldc = TPCollectives(mesh.etp_comm, meter=meter), TPCollectives(mesh.fold_comm, meter=meter)
        parts = TPParts(tpc, dtype=dtype, compute_dtype=compute_dtype, sequence_parallel=sequence_parallel,
                        etp_comm=etpc, fold_comm=foldc)
    if layout.pp > 1:
        from .pp import PipelineGPT
        from .pp.schedules import placement_of
        model = PipelineGPT(cfg, seed, pp=layout.pp, rank=mesh.pp_rank, v=layout.virtual_stages, dtype=dtype,
                            compute_dtype=compute_dtype, factory=parts, placement=placement_of(layout.schedule))
    elif parts is not None:
        from .tp import TPGPT
        model = TPGPT(cfg, parts.tp, seed=seed, dtype=dtype, sequence_parallel=sequence_parallel,
                      compute_dtype=compute_dtype, etp_comm=etpc, fold_comm=foldc)
    else:
        from ..nn.gpt import GPT
        model = GPT(cfg, seed=seed, dtype=dtype, compute_dtype=compute_dtype)
    if layout.ep > 1:                    # keep n_expert/ep experts; tokens move by alltoallv
        install_expert_parallel(model, mesh.ep_comm, meter, dispatch=ep_dispatch)
    return model
