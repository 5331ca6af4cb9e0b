"""Glue between a model/optimiser (any layout) and save/load: {global name: (array, Shard)}.

A model is anything with ``named_parameters()`` yielding (global nanoGPT name, Parameter),
where a sharded Parameter carries ``.shard`` (pympar/nn/parameter.py); buffers that are not trained but belong
in a checkpoint come from ``model.named_buffers()`` or, for pympar.nn.GPT, the MoE selection
biases. An optimiser either offers ``checkpoint_shards() -> ({key: (array, Shard|None)},
{scalars})`` (layouts whose state is not shaped like the parameters, e.g. ZeRO) or follows
AdamW's ``state_dict()``: scalars plus dicts {param name: array shaped like the parameter}.
"""
from __future__ import annotations

from dataclasses import asdict, is_dataclass

import numpy as np

from ..backend import to_numpy
from . import layout_io as L
from .loading import Checkpoint, load
from .saving import PendingSave, save

# config fields that decide the model's function and shapes: a resume must match them
ARCH_KEYS = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "bias", "n_expert",
             "moe_every", "top_k", "shared_expert")


def named_buffers(model):
    """[(global name, array)] of non-trained state kept in checkpoints."""
    if hasattr(model, "named_buffers"):
        return list(model.named_buffers())
    if hasattr(model, "moe_layers"):
        return [(f"transformer.h.{i}.moe.expert_bias", m.expert_bias) for i, m in model.moe_layers()]
    return []


def model_shards(model) -> dict:
    """{global name: (array, Shard or None)} of the model's parameters and buffers."""
    out = {name: (p.data, getattr(p, "shard", None)) for name, p in model.named_parameters()}
    out.update({name: (b, None) for name, b in named_buffers(model)})
    return out


def optimizer_shards(optimizer, model=None):
    """({state key: (array, Shard or None)}, {scalar state}); keys are ``<state>.<param name>``."""
    if optimizer is None:
        return {}, {}
    if hasattr(optimizer, "checkpoint_shards"):
        return optimizer.checkpoint_shards()
    params = dict(getattr(optimizer, "params", None) or (model.named_parameters() if model else ()))
    shards, scalars = {}, {}
    state = optimizer.state_views() if hasattr(optimizer, "state_views") else optimizer.state_dict()
    for key, val in state.items():
        if not isinstance(val, dict):
            scalars[key] = val.item() if hasattr(val, "item") else val
            continue
        for name, arr in val.items():
            p = params.get(name)
            if p is None:
                raise ValueError(f"optimizer state {key!r} holds {name!r}, which is not a parameter it knows")
            if tuple(np.shape(arr)) != tuple(p.data.shape):
                raise ValueError(f"optimizer state {key}.{name} has shape {np.shape(arr)}, its parameter "
                                 f"{p.data.shape}: give the optimizer a checkpoint_shards() method")
            shards[f"{key}.{name}"] = (arr, getattr(p, "shard", None))
    return shards, scalars


def config_dict(model):
    cfg = getattr(model, "config", None)
    return asdict(cfg) if is_dataclass(cfg) else (dict(cfg) if cfg else None)


def checkpoint_state(model, optimizer=None):
    """(shards, opt_shards, optimizer scalars) of this rank, ready for save()."""
    opt_shards, scalars = optimizer_shards(optimizer, model)
    return model_shards(model), opt_shards, scalars


def save_training(directory, step, model, optimizer=None, comm=None, meta=None, keep=None, rank_meta=None,
                  background=False, staging=None):
    """Collective: save model (and optimiser) state; meta gets config and the optimiser's scalars.

    meta: the trainer's JSON-able extras (layout, data position, loss scale, ...); rank_meta:
    this rank's JSON-able extras (its RNG state). Returns the checkpoint path; with
    ``background=True`` a started saving.PendingSave instead (the pieces copied to host memory,
    the file written by a thread; call its finish(), collectively, to publish it; ``staging``: the
    caller's {key: host buffer} reused from one background save to the next)."""
    shards, opt_shards, scalars = checkpoint_state(model, optimizer)
    meta = dict(meta or {})
    meta.setdefault("config", config_dict(model))
    meta["optimizer"] = scalars
    if background:
        return PendingSave(directory, step, shards, opt_shards, meta, comm, keep, rank_meta, copy=True,
                           staging=staging).start()
    return save(directory, step, shards, opt_shards, meta, comm, keep=keep, rank_meta=rank_meta)


def _wanted(shards):
    return {k: (spec if spec is not None else (np.shape(a), ())) for k, (a, spec) in shards.items()}


def restore_into(model, optimizer, directory, comm=None, check_config=True) -> dict:
    """Collective: load ``directory`` (a checkpoint or a root with ``latest``) into model and
    optimiser in place, resharding to their layout; returns the manifest (step, meta, ranks).

    A checkpoint without optimiser state (an import) leaves the optimiser as it is."""
    ck = Checkpoint(directory, verify=False)  # manifest only, to see what it holds; load verifies
    has_opt = any(k.startswith(L.OPT_PREFIX) for k in ck.tensors)
    params = model_shards(model)
    opt_shards, _ = optimizer_shards(optimizer, model) if (optimizer is not None and has_opt) else ({}, {})
    wanted = _wanted(params) | {L.OPT_PREFIX + k: w for k, w in _wanted(opt_shards).items()}
    cfg = config_dict(model) if check_config else None
    expect = {k: cfg[k] for k in ARCH_KEYS if k in cfg} if cfg else None
    arrays, manifest = load(ck.path, wanted, comm, expect_config=expect)
    for name, (dst, _) in params.items():
        _assign(dst, arrays[name])
    if opt_shards:
        scalars = manifest["meta"].get("optimizer", {})
        loaded = {k: arrays[L.OPT_PREFIX + k] for k in opt_shards}
        if hasattr(optimizer, "load_checkpoint_shards"):
            optimizer.load_checkpoint_shards(loaded, scalars)
        else:
            _load_optimizer(optimizer, loaded, scalars)
    return manifest


def _assign(dst, src):
    """Copy into the existing array in place (numpy or cupy), casting to its dtype."""
    if type(dst).__module__.startswith("cupy"):
        import cupy

        dst[...] = cupy.asarray(src, dtype=dst.dtype)
    else:
        dst[...] = np.asarray(src).astype(dst.dtype, copy=False)


def _load_optimizer(optimizer, loaded, scalars):
    """Rebuild the optimiser's state_dict from loaded arrays and saved scalars; load it."""
    sd = optimizer.state_dict()
    for key, val in sd.items():
        if isinstance(val, dict):
            sd[key] = {name: loaded[f"{key}.{name}"].astype(np.asarray(to_numpy(a)).dtype, copy=False)
                       for name, a in val.items()}
        elif key in scalars:
            sd[key] = scalars[key]
    optimizer.load_state_dict(sd)
