"""Generation on a parallel layout: tensor, pipeline and expert parallel ranks decode together.

Every rank of the job runs the same decoding loop (nn.generate.decode) on its part of the model
with its part of the key/value cache:
  * tensor parallelism: a rank caches its own heads' keys and values; c_proj's and the MLP's
    allreduces run inside the modules, and the vocabulary-parallel head gathers the full logits,
    so every tp rank samples the same token from the same generator;
  * pipeline parallelism: a step runs the global stages in order; the rank of each stage runs its
    blocks on the positions of the step and sends the activations (B, s, C) to the next stage's
    rank; the last stage's rank samples, and broadcasts the tokens over the pipeline group;
  * expert parallelism: the data-parallel replicas decode the same sequence in lockstep, so every
    MoE layer's all-to-all meets all its ranks at the same layer;
  * data (and context) parallelism: replicas; context parallelism is not used to decode (each
    position attends over the cache on its own rank).
Sequence parallelism changes no parameter and is not used (a step may be one position).
"""
from __future__ import annotations

import numpy as np

from ..nn.generate import Decoder, decode, embed, moe_inference


class PipelineDecoder(Decoder):
    """Decoder of a pipeline rank's PipelineGPT over ``pp_comm`` (its rank is the pipeline rank)."""

    def __init__(self, model, pp_comm, B):
        super().__init__(model, B)
        self.comm, part = pp_comm, model.part
        self.n_stage = part.n_stage
        self.owner = [part.rank_of(s)[0] for s in range(self.n_stage)]
        self.chunk = {ch.stage: ch for ch in model.chunks}
        self.last = self.owner[-1]

    def step(self, tokens):
        me, B, s = self.comm.rank, tokens.shape[0], tokens.shape[1]
        x = out = None
        for st in range(self.n_stage):
            if self.owner[st] != me:
                continue
            ch = self.chunk[st]
            if st == 0:
                x = embed(ch.embedding, tokens, self.t)
            elif self.owner[st - 1] != me:          # else: the previous stage ran here, x is its output
                buf = np.empty(self.model.activation_shape(B, s), self.model.act_dtype)   # what stages exchange
                x = self.comm.recv(buf, self.owner[st - 1], tag=st)
            x = self.kv.run(ch.h, x, self.t)
            if st == self.n_stage - 1:
                out = ch.head.logits(x[:, -1:])[:, -1]
            elif self.owner[st + 1] != me:
                self.comm.send(np.ascontiguousarray(x), self.owner[st + 1], tag=st + 1)
        self.t += s
        return out

    def agree(self, tokens):
        buf = np.empty((self.B, 1), np.int64) if tokens is None else np.ascontiguousarray(tokens, dtype=np.int64)
        return self.comm.broadcast(buf, root=self.last)


def decoder_for(model, mesh, B):
    """The Decoder of this rank's part of ``model`` on ``mesh`` (a pympar.parallel.mesh.Mesh)."""
    if mesh.pp > 1:
        return PipelineDecoder(model, mesh.pp_comm, B)
    return Decoder(model, B)


def generate_parallel(model, mesh, idx, n, top_k=None, temperature=1.0, rng=None):
    """Collective over the mesh: append n tokens to idx (B, T); every rank returns the same array,
    the tokens one process would sample from the same model with the same generator."""
    with moe_inference(model):
        return decode(decoder_for(model, mesh, np.shape(idx)[0]), idx, n, top_k, temperature, rng)


def build_for_generation(cfg, comm, layout):
    """(model, mesh): this rank's part of a GPT of config ``cfg`` on ``layout`` (a
    pympar.layout.Layout of comm.size ranks; its tp, pp, ep, virtual stages and schedule's
    placement are used, cp and sp are not: cp's ranks decode as replicas), parameters made on first
    use (restore a checkpoint into it; pympar.parallel.build). The layout has passed
    ``pympar.layout.check`` (the application does it on every rank before any communication, as the
    trainer's configuration does for build_runner)."""
    from .build import parallelize
    from .mesh import Mesh

    mesh = Mesh(comm, dp=layout.dp * layout.cp, pp=layout.pp, tp=layout.tp, ep=layout.ep, etp=layout.etp)
    model = parallelize(cfg, mesh, layout)
    return model, mesh
