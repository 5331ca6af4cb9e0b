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
from .errors import CheckpointCorrupt, CheckpointError, CheckpointMismatch
from .loading import Checkpoint, check_fits
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
    if len(tensors[WTE].shape) != 2 or len(tensors["transformer.wpe.weight"].shape) != 2:
        raise ValueError(f"{WTE} {tuple(tensors[WTE].shape)} and transformer.wpe.weight "
                         f"{tuple(tensors['transformer.wpe.weight'].shape)}: expected (rows, n_embd) matrices")
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
        moe_blocks = sorted({int(m.group(1)) for k in tensors if (m := re.match(r"transformer\.h\.(\d+)\.moe\.", k))})
        if not moe_blocks:
            raise ValueError("expert tensors (.moe.experts.N.) outside transformer.h.N.moe: not a pympar MoE state dict")
        cfg.update(n_expert=max(experts) + 1, moe_every=moe_blocks[0] + 1,
                   shared_expert=any(".moe.shared." in k for k in tensors))
    return cfg


def import_state_dict(in_file, directory, config: dict | None = None, n_head=None, step: int = 0):
    """Write a step-``step`` checkpoint in ``directory`` from a nanoGPT-named safetensors file."""
    tensors, metadata = st.read_mapped(in_file)       # mapped, not copied: the save streams them
    _untie(tensors, in_file)
    from ..nn.config import GPTConfig
    unknown = sorted(set(config or {}) - {f.name for f in fields(GPTConfig)})
    if unknown:
        raise ValueError(f"--config: {', '.join(unknown)} is not a GPTConfig field")
    if "pympar.config" in metadata:
        raw = metadata["pympar.config"]
        try:                          # a header's metadata values may be of any JSON type, not only strings
            cfg = json.loads(raw) if isinstance(raw, str) else None
        except (ValueError, RecursionError):
            cfg = None
        if not isinstance(cfg, dict):
            raise CheckpointCorrupt(in_file, "metadata 'pympar.config': expected a JSON object")
        if n_head is not None and n_head != cfg.get("n_head"):
            raise CheckpointMismatch(in_file, f"it records n_head={cfg.get('n_head')} (pympar metadata); --n-head "
                                              f"{n_head} does not apply to it")
    else:
        cfg = infer_config(tensors, n_head if n_head is not None else (config or {}).get("n_head"))
    cfg.update(config or {})
    return _save_imported(tensors, cfg, in_file, directory, step)


def _untie(tensors, source):
    if LM_HEAD in tensors:
        lm = tensors.pop(LM_HEAD)
        if WTE in tensors and not _equal(lm, tensors[WTE]):
            raise CheckpointMismatch(source, f"{LM_HEAD} differs from {WTE}: pympar ties them")


def _equal(a, b, rows: int = 4096) -> bool:
    """np.array_equal in blocks of rows: no temporary the size of a (mapped) tensor."""
    if a.shape != b.shape:
        return False
    if a.ndim == 0:
        return bool(a == b)
    return all(np.array_equal(a[i:i + rows], b[i:i + rows]) for i in range(0, len(a), rows))


def _save_imported(tensors, cfg, in_file, directory, step):
    """Check nanoGPT-named ``tensors`` against GPTConfig ``cfg`` and write the checkpoint."""
    from ..nn.config import GPTConfig
    from ..nn.gpt import GPT

    try:
        gcfg = GPTConfig.from_dict(cfg)
    except (TypeError, ValueError) as e:
        raise CheckpointMismatch(in_file, f"the config is not a valid GPTConfig: {e}") from None
    check_fits(gcfg, sum(int(v.size) for v in tensors.values()), in_file)
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


# --- Hugging Face transformers (GPT2LMHeadModel) ---------------------------------------------
# GPT-2's Linear layers are Conv1D modules: weight (in, out), the transpose of nanoGPT's and
# pympar's (out, in). Everything else has nanoGPT's names and shapes; lm_head is tied to wte.
HF_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
HF_CONFIG, HF_WEIGHTS, HF_PICKLE = "config.json", "model.safetensors", "pytorch_model.bin"
HF_GELU = ("gelu_new", "gelu_pytorch_tanh")    # the tanh form of GELU, pympar's


def _is_conv1d(name):
    return name.startswith("transformer.h.") and name.endswith(HF_CONV1D)


def export_hf(directory, out_dir, dtype=None) -> dict:
    """Write checkpoint ``directory`` as a Hugging Face GPT-2 directory (config.json and
    model.safetensors) that ``transformers.GPT2LMHeadModel.from_pretrained(out_dir)`` loads;
    return {name: shape}. MoE models and models without biases are refused (GPT-2 has neither
    experts nor bias-free layers)."""
    ck = Checkpoint(directory)
    cfg = ck.meta.get("config") or {}
    if cfg.get("n_expert", 0):
        raise CheckpointMismatch(ck.path, f"an MoE model ({cfg['n_expert']} experts) has no GPT-2 form: GPT-2 has no "
                                          f"experts. Export it with --format nanogpt (pympar's names, MoE tensors "
                                          f"under transformer.h.N.moe.*; see docs/checkpoint.md)")
    if not cfg.get("bias", True):
        raise CheckpointMismatch(ck.path, "a model without biases has no GPT-2 form (GPT-2 has a bias on every "
                                          "linear and LayerNorm): export it with --format nanogpt")
    tensors = {k: ck.read(k) for k in sorted(ck.tensors) if not k.startswith(L.OPT_PREFIX)}
    if dtype is not None:
        tensors = {k: v.astype(dtype) for k, v in tensors.items()}
    hf = {k: (np.ascontiguousarray(v.T) if _is_conv1d(k) else v) for k, v in tensors.items()}
    vocab, n_embd = tensors[WTE].shape
    config = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": int(vocab), "n_positions": int(cfg.get("block_size", tensors["transformer.wpe.weight"].shape[0])),
        "n_embd": int(n_embd), "n_layer": int(cfg["n_layer"]), "n_head": int(cfg["n_head"]), "n_inner": None,
        "activation_function": "gelu_new", "layer_norm_epsilon": float(cfg.get("ln_eps", 1e-5)),
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "initializer_range": 0.02,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        # the byte vocabulary has no special tokens: the last id stands for both (GPT-2's 50256 is too)
        "bos_token_id": int(vocab) - 1, "eos_token_id": int(vocab) - 1, "tie_word_embeddings": True,
        "torch_dtype": str(next(iter(hf.values())).dtype), "pympar": {"step": ck.step, "config": cfg},
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / HF_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    st.write(out / HF_WEIGHTS, hf, {"format": "pt"})
    return {k: v.shape for k, v in hf.items()}


HF_INTS = ("vocab_size", "n_positions", "n_layer", "n_head", "n_embd")


def _hf_config(path) -> dict:
    """config.json read and checked: an object, its size fields positive integers (a model is
    allocated from them), layer_norm_epsilon a number; CheckpointCorrupt naming the field."""
    try:
        if path.stat().st_size > 1 << 20:
            raise CheckpointCorrupt(path, "larger than any config.json (1 MiB at most)")
        hc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        if isinstance(e, CheckpointCorrupt):
            raise
        raise CheckpointCorrupt(path, f"unreadable ({type(e).__name__})") from None
    if not isinstance(hc, dict):
        raise CheckpointCorrupt(path, "expected a JSON object")
    for k in HF_INTS:
        v = hc.get(k)
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v < 2 ** 40:
            raise CheckpointCorrupt(path, f"field {k!r}: expected an integer >= 1")
    eps = hc.get("layer_norm_epsilon", 1e-5)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool):
        raise CheckpointCorrupt(path, "field 'layer_norm_epsilon': expected a number")
    return hc


def import_hf(src_dir, directory, step: int = 0):
    """Write a step-``step`` checkpoint in ``directory`` from a Hugging Face GPT-2 directory
    (config.json + model.safetensors): Conv1D weights transposed, the tied head dropped,
    GPT-2's attention-mask buffers ignored. pytorch_model.bin is refused: it is a pickle."""
    src = Path(src_dir)
    if not (src / HF_CONFIG).is_file():
        raise CheckpointMismatch(src, f"no {HF_CONFIG}: expected a Hugging Face model directory "
                                      f"({HF_CONFIG} and {HF_WEIGHTS})")
    hc = _hf_config(src / HF_CONFIG)
    if hc.get("model_type") != "gpt2":
        raise CheckpointMismatch(src / HF_CONFIG, f"model_type {hc.get('model_type')!r}: only GPT-2 ('gpt2') "
                                                   f"maps onto pympar's GPT")
    if not (src / HF_WEIGHTS).is_file():
        why = (f"{HF_PICKLE} is a Python pickle, which can run code when loaded; pympar does not load pickles "
               f"(nor depend on PyTorch). Convert it once where transformers is installed: "
               f"GPT2LMHeadModel.from_pretrained(DIR).save_pretrained(DIR, safe_serialization=True)"
               if (src / HF_PICKLE).is_file() else f"no {HF_WEIGHTS}")
        raise CheckpointMismatch(src, why)
    act = hc.get("activation_function", "gelu_new")
    if act not in HF_GELU:
        raise CheckpointMismatch(src / HF_CONFIG, f"activation_function {act!r}: pympar's MLP uses GELU in its "
                                                   f"tanh form ({' or '.join(HF_GELU)}); the model would compute "
                                                   f"other numbers")
    n_embd = hc["n_embd"]
    if hc.get("n_inner") not in (None, 4 * n_embd):
        raise CheckpointMismatch(src / HF_CONFIG, f"n_inner {hc['n_inner']}: pympar's MLP is 4 x n_embd = {4 * n_embd}")
    if hc.get("scale_attn_by_inverse_layer_idx") or hc.get("reorder_and_upcast_attn"):
        raise CheckpointMismatch(src / HF_CONFIG, "scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn: "
                                                   "pympar's attention has neither")
    raw, _ = st.read_mapped(src / HF_WEIGHTS)
    tensors = {}
    for k, v in raw.items():
        name = k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k   # GPT2Model files
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            continue              # GPT-2's causal-mask buffers, not weights
        tensors[name] = np.ascontiguousarray(v.T) if _is_conv1d(name) else v
    _untie(tensors, src / HF_WEIGHTS)
    cfg = {"vocab_size": hc["vocab_size"], "block_size": hc["n_positions"], "n_layer": hc["n_layer"],
           "n_head": hc["n_head"], "n_embd": n_embd, "bias": True,
           "ln_eps": float(hc.get("layer_norm_epsilon", 1e-5))}
    return _save_imported(tensors, cfg, src / HF_WEIGHTS, directory, step)
