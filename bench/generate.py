"""Generation speed with and without the key/value cache (pympar.nn.generate), one process.

A GPT of 4 layers, 256 wide, 4 heads, block size 1024 (random weights: speed only), greedy,
from a 1-token prompt up to 256 and to 1024 positions. Without the cache every new token runs
the whole sequence so far; with it, one position. Tokens/s = generated tokens / wall time.

    python bench/generate.py --json bench/results/generate.json
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--positions", default="256,1024")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=str(common.RESULTS / "generate.json"))
    a = ap.parse_args(argv)
    from pympar import kernels
    from pympar.config import apply_environment
    apply_environment()
    from pympar.nn.config import GPTConfig
    from pympar.nn.generate import generate
    from pympar.nn.gpt import GPT

    kernels.set_process_threads(a.threads)
    positions = [int(p) for p in a.positions.split(",")]
    cfg = GPTConfig(n_layer=a.layers, n_embd=a.width, n_head=max(1, a.width // 64), block_size=max(positions))
    model = GPT(cfg.validate())
    rows = []
    for pos in positions:
        got = {}
        for cache in (True, False):
            t0 = time.perf_counter()
            out = generate(model, np.array([[1]]), pos - 1, top_k=1, cache=cache)
            dt = time.perf_counter() - t0
            got[cache] = out
            rows.append(dict(positions=pos, cache=cache, seconds=dt, tokens_per_s=(pos - 1) / dt))
            print(f"  {pos} positions, {'cache   ' if cache else 'no cache'}: {dt:7.2f} s  {(pos - 1) / dt:9.1f} tokens/s",
                  flush=True)
        rows[-2]["same_tokens"] = rows[-1]["same_tokens"] = bool(np.array_equal(got[True], got[False]))
    res = dict(kind="generate", machine=common.machine(), config=dict(n_layer=cfg.n_layer, n_embd=cfg.n_embd,
               n_head=cfg.n_head, block_size=cfg.block_size), threads=a.threads, rows=rows)
    common.write_json(a.json, res)
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
