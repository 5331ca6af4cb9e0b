"""The last pipeline stage's head in one pass (forward and backward in F, each chunk's logits
computed once) against forward and backward apart (the logits computed again in B), in one run:
real GPT blocks, a GPT-2-sized vocabulary, pp = the world size, 1F1B. Steps alternate between the
two (A B, B A, ...) after one warm-up step of each; the median step times and their ratio are
printed, with each pair's ratio (the spread says how far to trust the median). Each rank takes its share
of the node's cores (pympar.parallel.cores) unless PYMPAR_NUM_THREADS or OMP_NUM_THREADS is set.

    mpiexec -n 2 python bench/pipeline_head.py                        # L8 C256 V50304 T1024, 4 micro-batches
    mpiexec -n 2 python bench/pipeline_head.py --layers 2 --pairs 7 --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--seq", type=int, default=1024, help="tokens per micro-batch (batch 1)")
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--pairs", type=int, default=5, help="timed (fused, apart) pairs")
    ap.add_argument("--json", type=Path)
    return ap.parse_args(argv)


def main(argv=None):
    a = parse(argv)
    import numpy as np
    from mpi4py import MPI

    from pympar.comm import MPIComm
    from pympar.config import apply_environment
    from pympar.nn import GPTConfig
    from pympar.parallel.cores import share_cores
    from pympar.parallel.pp import PipelineExecutor, PipelineGPT
    from pympar.nn.gpt import GPT

    env = apply_environment()
    w = MPI.COMM_WORLD
    threads, _ = share_cores(w, env.threads, env.threads_from)   # each rank its share of the node's cores
    cfg = GPTConfig(vocab_size=a.vocab, block_size=a.seq, n_layer=a.layers, n_head=max(1, a.embd // 64),
                    n_embd=a.embd).validate()
    model = PipelineGPT(cfg, seed=0, pp=w.size, rank=w.rank, dtype=np.float32)
    ex = PipelineExecutor(model, MPIComm(w), "1f1b")
    rng = np.random.default_rng(0)
    mbs = [(rng.integers(0, a.vocab, (1, a.seq)), rng.integers(0, a.vocab, (1, a.seq))) for _ in range(a.micro)]
    head = [c for c in model.chunks if c.head is not None]
    fuses = w.allreduce(int(bool(head) and head[0].head_fuses(a.seq)))
    if not fuses and w.rank == 0:
        print("note: the head keeps its logits whole at this shape (nothing is recomputed): both runs are one path")
    one_pass = GPT.head_fuses

    def step(fused):
        GPT.head_fuses = one_pass if fused else (lambda self, n: False)
        model.zero_grad()
        w.Barrier()
        t = time.perf_counter()
        loss = ex.train_step(mbs)["loss"]
        w.Barrier()
        return time.perf_counter() - t, loss

    for fused in (True, False):                  # a warm-up step of each
        step(fused)
    times, losses = {True: [], False: []}, {True: set(), False: set()}
    for i in range(a.pairs):
        for f in ((True, False) if i % 2 == 0 else (False, True)):
            s, loss = step(f)
            times[f].append(s)
            losses[f].add(loss)
    GPT.head_fuses = one_pass
    if w.rank != 0:
        return
    fused, apart = float(np.median(times[True])), float(np.median(times[False]))
    pairs = [b / f for f, b in zip(times[True], times[False])]
    shape = f"pp{w.size} L{a.layers} C{a.embd} V{a.vocab} T{a.seq} m{a.micro}"
    print(f"{shape}, {threads} thread(s) per rank: one pass {fused:.3f} s/step, apart {apart:.3f} s/step, apart/one pass {apart / fused:.3f}x "
          f"(pairs {min(pairs):.3f}-{max(pairs):.3f}); same loss: {losses[True] == losses[False]}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"shape": shape, "one_pass_s": fused, "apart_s": apart, "ratio": apart / fused,
                                      "pair_ratios": pairs, "same_loss": losses[True] == losses[False],
                                      "fuses": bool(fuses), "threads": threads}, indent=1))


if __name__ == "__main__":
    main()
