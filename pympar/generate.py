"""python -m pympar.generate SRC --prompt TEXT: sample from a checkpoint, one process.

    python -m pympar.generate runs/tiny4 --prompt "def " --tokens 200 --top-k 20 --seed 1
    python -m pympar.generate runs/tiny4 --prompt "import " --top-k 1        # greedy

SRC: a run directory (the trainer's --out), its checkpoints/ folder or one step_N checkpoint,
of any layout: the model is assembled whole on this process (pympar.checkpoint resharding). The
byte vocabulary (256 tokens) takes the prompt as UTF-8 bytes and prints text; other vocabularies
take ``--prompt-ids 1,2,3`` and print token ids. Generation keeps a key/value cache (each new
token costs one position; ``--no-cache`` runs the whole window per token, for comparison) and
samples as the trainer's sample does: temperature, then top-k, then a draw from ``--seed``.
The Python API is ``pympar.nn.generate.generate(model, idx, n, top_k, temperature, rng)``.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from .config import start_application


def build_parser():
    p = argparse.ArgumentParser(prog="python -m pympar.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="run directory, its checkpoints/ folder, or one step_N checkpoint")
    p.add_argument("--prompt", default="\n", help="text (byte vocabulary); default: a newline")
    p.add_argument("--prompt-ids", default=None, help="comma-separated token ids instead of --prompt")
    p.add_argument("--tokens", type=int, default=200, help="tokens to generate (default: 200)")
    p.add_argument("--temperature", type=float, default=1.0, help="divide the logits by this (default: 1.0)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely (1: greedy)")
    p.add_argument("--seed", type=int, default=0, help="the sampling generator's seed (default: 0)")
    p.add_argument("--no-cache", action="store_true", help="no key/value cache: the whole window per token")
    return p


def load_model(src):
    """(GPT with the checkpoint's weights, its step), on this process."""
    from .checkpoint import Checkpoint, restore_into
    from .nn.config import GPTConfig
    from .nn.gpt import GPT

    ck = Checkpoint(src, verify=False)
    cfg = ck.meta.get("config")
    if not cfg:
        raise ValueError(f"{ck.path}: the checkpoint records no model config")
    model = GPT(GPTConfig(**{k: v for k, v in cfg.items() if k in GPTConfig.__dataclass_fields__}).validate())
    restore_into(model, None, ck.path)
    return model, ck.step


def main(argv=None) -> int:
    from .checkpoint import CheckpointError

    start_application("pympar.generate")
    a = build_parser().parse_args(argv)
    try:
        if a.tokens < 0 or a.temperature <= 0 or (a.top_k is not None and a.top_k < 1):
            raise ValueError("--tokens must be >= 0, --temperature > 0 and --top-k >= 1")
        model, step = load_model(a.src)
        V = model.config.vocab_size
        if a.prompt_ids is not None:
            ids = [int(t) for t in a.prompt_ids.split(",") if t.strip()]
        elif V == 256:
            ids = list(a.prompt.encode("utf-8"))
        else:
            raise ValueError(f"the model's vocabulary has {V} tokens, not pympar's 256 bytes: give the prompt as "
                             f"--prompt-ids 1,2,3")
        if not ids or min(ids) < 0 or max(ids) >= V:
            raise ValueError(f"prompt ids must be 0..{V - 1} and at least one")
    except (ValueError, OSError, CheckpointError) as e:
        print(f"pympar.generate: error: {e}", file=sys.stderr)
        return 2
    from .nn.generate import generate

    t0 = time.perf_counter()
    out = generate(model, np.array([ids], np.int64), a.tokens, top_k=a.top_k, temperature=a.temperature,
                   rng=np.random.default_rng(a.seed), cache=not a.no_cache)
    dt = time.perf_counter() - t0
    new = out[0, len(ids):].tolist()
    if V == 256 and a.prompt_ids is None:
        sys.stdout.write(bytes(ids + new).decode("utf-8", errors="replace") + "\n")
    else:
        print(",".join(map(str, ids + new)))
    print(f"pympar.generate: {len(new)} tokens from step {step} in {dt:.2f} s ({len(new) / max(dt, 1e-9):,.0f} "
          f"tokens/s, {'no cache' if a.no_cache else 'key/value cache'})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
