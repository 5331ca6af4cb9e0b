"""A checkpoint <-> one nanoGPT-named safetensors state dict (what PyTorch's nanoGPT loads).

export: every model tensor gathered whole from whatever layout wrote it, plus
``lm_head.weight`` (= ``transformer.wte.weight``, tied as in nanoGPT); optimiser state is left out.
import: the reverse, a step-0 checkpoint with every tensor whole, to start training from.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, fields
from pathlib import Path

import numpy as np

from . import layout_io as L
from . import safetensors_format as st
from .errors import CheckpointError, CheckpointMismatch
from .loading import Checkpoint
from .saving import full_shards, save

WTE, LM_HEAD = "transformer.wte.weight", "lm_head.weight"


def export_state_dict(directory, out_file, dtype=None, lm_head: bool = True) -> dict:
    """Write the model tensors of checkpoint ``directory`` to ``out_file``; return {name: shape}."""
    ck = Checkpoint(directory)
    tensors = {k: ck.read(k) for k in sorted(ck.tensors) if not k.startswith(L.OPT_PREFIX)}
    if dtype is not None:
        tensors = {k: v.astype(dtype) for k, v in tensors.items()}
    if lm_head and WTE in tensors:
        tensors[LM_HEAD] = tensors[WTE]
    metadata = {"format": "pt", "pympar.step": str(ck.step)}
    if ck.meta.get("config") is not None:
        metadata["pympar.config"] = json.dumps(ck.meta["config"])
    st.write(out_file, tensors, metadata)
    return {k: v.shape for k, v in tensors.items()}


def infer_config(tensors: dict, n_head=None) -> dict:
    """GPTConfig fields readable from the tensor shapes (n_head is not: give it)."""
    if WTE not in tensors or "transformer.wpe.weight" not in tensors:
        raise ValueError(f"no {WTE} / transformer.wpe.weight: not a GPT state dict")
    vocab, n_embd = tensors[WTE].shape
    layers = {int(m.group(1)) for k in tensors if (m := re.match(r"transformer\.h\.(\d+)\.", k))}
    experts = {int(m.group(1)) for k in tensors if (m := re.search(r"\.moe\.experts\.(\d+)\.", k))}
    if n_head is None:
        raise ValueError("the number of heads cannot be read from tensor shapes: pass --n-head "
                         "(GPT-2 uses n_embd/64) or --config '{\"n_head\": ...}'")
    cfg = dict(vocab_size=vocab, block_size=tensors["transformer.wpe.weight"].shape[0],
               n_layer=max(layers) + 1 if layers else 0, n_head=int(n_head), n_embd=n_embd,
               bias="transformer.h.0.attn.c_attn.bias" in tensors)
    if experts:
        moe_blocks = sorted({int(k.split(".")[2]) for k in tensors if ".moe." in k})
        cfg.update(n_expert=max(experts) + 1, moe_every=moe_blocks[0] + 1,
                   shared_expert=any(".moe.shared." in k for k in tensors))
    return cfg


def import_state_dict(in_file, directory, config: dict | None = None, n_head=None, step: int = 0):
    """Write a step-``step`` checkpoint in ``directory`` from a nanoGPT-named safetensors file."""
    from ..nn.config import GPTConfig
    from ..nn.gpt import GPT

    tensors, metadata = st.read_all(in_file)
    if LM_HEAD in tensors:
        lm = tensors.pop(LM_HEAD)
        if WTE in tensors and not np.array_equal(lm, tensors[WTE]):
            raise CheckpointMismatch(in_file, f"{LM_HEAD} differs from {WTE}: pympar ties them")
    cfg = json.loads(metadata["pympar.config"]) if "pympar.config" in metadata else infer_config(tensors, n_head)
    cfg.update(config or {})
    known = {f.name for f in fields(GPTConfig)}
    try:
        gcfg = GPTConfig(**{k: v for k, v in cfg.items() if k in known}).validate()
    except (TypeError, ValueError) as e:
        raise CheckpointMismatch(in_file, f"config {cfg} is not a valid GPTConfig: {e}") from None
    want = {k: v.shape for k, v in GPT(gcfg).state_dict().items()}
    missing = sorted(set(want) - set(tensors))
    unexpected = sorted(set(tensors) - set(want))
    shapes = sorted(k for k in set(want) & set(tensors) if tuple(want[k]) != tuple(tensors[k].shape))
    if missing or unexpected or shapes:
        raise CheckpointMismatch(in_file, f"does not match config {asdict(gcfg)}: missing {missing[:5]}, "
                                          f"unexpected {unexpected[:5]}, wrong shapes {shapes[:5]}")
    meta = {"config": asdict(gcfg), "imported_from": str(Path(in_file).name)}
    return save(directory, step, full_shards(tensors), {}, meta)


def describe_checkpoint(directory, verify: bool = False) -> str:
    """A readable summary: manifest, files, and per tensor its shape, dtype and covering pieces."""
    ck = Checkpoint(directory)
    m = ck.manifest
    lines = [f"checkpoint {ck.path}", f"  step {m['step']}   written by {m['world_size']} rank(s)"]
    for key, val in sorted(ck.meta.items()):
        lines.append(f"  {key}: {json.dumps(val, sort_keys=True)[:200]}")
    lines.append(f"  files ({len(m['files'])}):")
    for fname, rec in sorted(m["files"].items()):
        status = ""
        if verify:
            try:
                ck._file(fname)
                status = "  ok"
            except CheckpointError as e:
                status = f"  DAMAGED: {e.problem}"
        lines.append(f"    {fname}  rank {rec['rank']}  {rec['bytes']} bytes  sha256 {rec['sha256'][:12]}{status}")
    rows = [("tensor", "full shape", "dtype", "pieces (file:rank index)")]
    for key, t in sorted(ck.tensors.items()):
        pieces = "; ".join(f"r{p['rank']}:" + ",".join("+".join(f"{a}:{b}" for a, b in dim) for dim in p["index"])
                           for p in t["pieces"])
        rows.append((key, "x".join(map(str, t["full_shape"])) or "scalar", t["dtype"], pieces))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3])
    return "\n".join(lines)
