"""python -m pympar.checkpoint export DIR model.safetensors | import model.safetensors DIR | inspect DIR

    export  write one nanoGPT-named state dict (PyTorch: safetensors.torch.load_file) from a
            checkpoint of any layout (DIR: a run directory (--out), its checkpoints/ folder,
            or one step_N checkpoint); --format hf: a Hugging Face GPT-2 directory instead
            (config.json + model.safetensors, for GPT2LMHeadModel.from_pretrained)
    import  make a step-0 checkpoint from such a file (--format hf: from a Hugging Face GPT-2
            directory), to start training from it
    inspect print the manifest, the files and which ranks' files cover each tensor
"""
from __future__ import annotations

import argparse
import json
import sys

from ..backend import dtype as resolve_dtype
from ..config import start_application
from .convert import describe_checkpoint, export_hf, export_state_dict, import_hf, import_state_dict
from .errors import CheckpointError

PROG = "pympar.checkpoint"     # every error line: "pympar.checkpoint: error: ..."


def _check_import_target(directory, step: int) -> None:
    """import writes DIR/step_N and DIR/latest: into a new or empty folder only (never over a run's
    folder or other checkpoints, whose latest it would replace), at a step >= 0."""
    from pathlib import Path
    if step < 0:
        raise ValueError(f"--step {step} must be >= 0")
    d = Path(directory)
    if d.exists() and not d.is_dir():
        raise ValueError(f"{d}: exists and is not a directory; give a new or empty directory")
    held = sorted(p.name for p in d.iterdir() if not p.name.startswith(".")) if d.is_dir() else []
    if held:
        raise ValueError(f"{d} already holds {', '.join(held[:4])}{', ...' if len(held) > 4 else ''}: import writes "
                         f"a step_N checkpoint and 'latest' there; give a new or empty directory")


def main(argv=None) -> int:
    start_application(PROG)
    ap = argparse.ArgumentParser(prog="python -m pympar.checkpoint", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="checkpoint -> one nanoGPT-named safetensors file")
    ex.add_argument("dir")
    ex.add_argument("out", help="the .safetensors file (--format nanogpt) or directory (--format hf) to write")
    ex.add_argument("--format", default="nanogpt", choices=("nanogpt", "hf"),
                    help="nanogpt: one state dict with nanoGPT's names; hf: a transformers GPT-2 directory")
    ex.add_argument("--dtype", default=None, help="cast every tensor (float32, bfloat16, float16)")
    ex.add_argument("--no-lm-head", action="store_true", help="leave out lm_head.weight (tied to wte)")
    im = sub.add_parser("import", help="nanoGPT-named safetensors file -> step-0 checkpoint")
    im.add_argument("file", help="the .safetensors file (--format nanogpt) or HF directory (--format hf)")
    im.add_argument("dir")
    im.add_argument("--format", default="nanogpt", choices=("nanogpt", "hf"),
                    help="hf: read config.json and model.safetensors of a transformers GPT-2 directory")
    im.add_argument("--n-head", type=int, default=None, help="heads (not readable from shapes)")
    im.add_argument("--config", default=None, help="JSON of GPTConfig fields to set")
    im.add_argument("--step", type=int, default=0)
    ins = sub.add_parser("inspect", help="print what a checkpoint holds")
    ins.add_argument("dir")
    ins.add_argument("--verify", action="store_true", help="check every file's size and sha256")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "import":
            _check_import_target(a.dir, a.step)
        if a.cmd == "export" and a.format == "hf":
            shapes = export_hf(a.dir, a.out, resolve_dtype(a.dtype) if a.dtype else None)
            print(f"wrote {len(shapes)} tensors and config.json to {a.out} "
                  f"(transformers.GPT2LMHeadModel.from_pretrained({str(a.out)!r}))")
        elif a.cmd == "export":
            shapes = export_state_dict(a.dir, a.out, resolve_dtype(a.dtype) if a.dtype else None,
                                       lm_head=not a.no_lm_head)
            print(f"wrote {len(shapes)} tensors to {a.out}")
        elif a.cmd == "import" and a.format == "hf":
            if a.config or a.n_head:
                raise ValueError("import --format hf reads the model from config.json: --config and --n-head "
                                 "do not apply")
            path = import_hf(a.file, a.dir, step=a.step)
            print(f"wrote checkpoint {path}")
        elif a.cmd == "import":
            try:
                cfg = json.loads(a.config) if a.config else None
            except ValueError as e:
                raise ValueError(f"--config {a.config!r}: not JSON ({e})") from None
            if cfg is not None and not isinstance(cfg, dict):
                raise ValueError("--config must be a JSON object of GPTConfig fields")
            path = import_state_dict(a.file, a.dir, cfg, n_head=a.n_head, step=a.step)
            print(f"wrote checkpoint {path}")
        else:
            text = describe_checkpoint(a.dir, verify=a.verify)
            print(text)
            if a.verify and "DAMAGED" in text:
                return 1
    except (CheckpointError, ValueError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:                 # the output: a folder that cannot be written, a full disk
        print(f"{PROG}: error: {e.filename or ''}: {e.strerror or type(e).__name__}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
