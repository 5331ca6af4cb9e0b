"""python -m pympar.generate SRC --prompt TEXT: sample from a checkpoint, on one process or on a layout.

    python -m pympar.generate runs/tiny4 --prompt "def " --tokens 200 --top-k 20 --seed 1
    python -m pympar.generate runs/tiny4 --prompt "import " --top-k 1        # greedy
    mpirun -n 4 python -m pympar.generate runs/tp2pp2 --prompt "def "      # on the saved tp x pp layout

SRC: a run directory (the trainer's --out), its checkpoints/ folder or one step_N checkpoint,
of any layout. On one process the model is assembled whole (pympar.checkpoint resharding).
Under an MPI launcher with more than one rank the model is built on a tp x pp (x ep) layout --
the one the checkpoint was saved with, or --tp/--pp/--ep/--etp -- with dp = ranks / (tp * pp)
replicas, and the ranks decode together (pympar.parallel.generate: each rank holds its shards
and its own heads' key/value cache; a pipeline passes each step's activations from stage to
stage); every rank gets the tokens one process would sample. The byte vocabulary (256 tokens)
takes the prompt as UTF-8 bytes and prints text; other vocabularies take ``--prompt-ids 1,2,3``
and print token ids. Generation keeps a key/value cache (each new token costs one position;
``--no-cache``, on one process, runs the whole window per token, for comparison) and samples as
the trainer's sample does: temperature, then top-k, then a draw from ``--seed``. The Python API
is ``pympar.nn.generate.generate(model, idx, n, top_k, temperature, rng)`` and, on a layout,
``pympar.parallel.generate.generate_parallel(model, mesh, idx, n, ...)``.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from .config import start_application
from .resilience import first_non_finite


def build_parser():
    p = argparse.ArgumentParser(prog="python -m pympar.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="run directory, its checkpoints/ folder, or one step_N checkpoint")
    p.add_argument("--prompt", default=None, help="text (byte vocabulary); default: a newline")
    p.add_argument("--prompt-ids", default=None, help="comma-separated token ids instead of --prompt")
    p.add_argument("--tokens", type=int, default=200, help="tokens to generate (default: 200)")
    p.add_argument("--temperature", type=float, default=1.0, help="divide the logits by this (default: 1.0)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely (1: greedy)")
    p.add_argument("--seed", type=int, default=0, help="the sampling generator's seed (default: 0)")
    p.add_argument("--no-cache", action="store_true",
                   help="no key/value cache: the whole window per token (one process only)")
    for k in ("tp", "pp", "ep"):
        p.add_argument(f"--{k}", type=int, default=None,
                       help=f"{k} of the layout to decode on, under an MPI launcher (default: the checkpoint's)")
    p.add_argument("--expert-replicas", type=int, default=0, metavar="R",
                   help="MoE on a layout with --ep > 1 (tp 1): R replica slots per ep rank, placed once before "
                        "decoding from the expert loads the prompt's prefill measures (the busiest experts get "
                        "copies on the least-loaded ranks, as in training; docs/parallel.md); default 0")
    p.add_argument("--etp", type=int, default=None,
                   help="the experts' tensor parallelism, a divisor of --tp: below tp the experts are folded apart "
                        "and --ep may reach over the tp ranks (default: the checkpoint's when no --tp/--ep is given, "
                        "else tp)")
    return p


def config_of(ck):
    """The GPTConfig a checkpoint records, checked against what the checkpoint holds."""
    return ck.model_config()


def load_model(src):
    """(GPT with the checkpoint's weights, its step), on this process."""
    from .checkpoint import Checkpoint, restore_into
    from .nn.gpt import GPT

    ck = Checkpoint(src, verify=False)
    model = GPT(config_of(ck))
    restore_into(model, None, ck.path)
    return model, ck.step


def saved_layout(meta) -> dict:
    """tp, pp, ep, etp, virtual_stages and schedule of the layout a checkpoint was saved with (1, 1, 1,
    None, 1, 1f1b where it records none: an import)."""
    lay = meta.get("layout") if isinstance(meta.get("layout"), dict) else {}

    def size(key, default):
        v = lay.get(key, default)
        if v is None and default is None:
            return None
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"the checkpoint's meta.layout.{key} is {v!r}: expected an integer >= 1")
        return v
    return dict(tp=size("tp", 1), pp=size("pp", 1), ep=size("ep", 1), etp=size("etp", None),
                virtual_stages=size("virtual_stages", 1), schedule=str(lay.get("schedule", "1f1b")))


def decode_layout(a, meta, world: int):
    """The pympar.layout.Layout to decode on with ``world`` ranks: --tp/--pp/--ep, else the layout
    the checkpoint was saved with; dp the rest."""
    from .layout import Layout

    saved = saved_layout(meta)
    lay = dict(saved)
    given = {k: getattr(a, k) for k in ("tp", "pp", "ep", "etp") if getattr(a, k) is not None}
    if any(v < 1 for v in given.values()):
        raise ValueError("--tp, --pp, --ep and --etp must be >= 1")
    if "etp" not in given and ("tp" in given or "ep" in given):
        lay["etp"] = None                             # another expert grid: unfolded unless --etp says
    lay.update(given)
    if lay["pp"] == 1 or lay["pp"] != saved["pp"]:   # no pipeline, or another one: plain stages
        lay.update(virtual_stages=1, schedule="1f1b")
    tp, pp, ep = lay["tp"], lay["pp"], lay["ep"]
    if world % (tp * pp):
        why = "" if given else f" (the layout the checkpoint was saved with: tp={saved['tp']}, pp={saved['pp']})"
        raise ValueError(f"{world} ranks do not divide into tp={tp} x pp={pp}{why}: run on a multiple of "
                         f"{tp * pp} ranks, or give --tp/--pp whose product divides {world}")
    # ep and etp against the mesh: pympar.layout.check (Mesh.validate), which main runs next
    return Layout(dp=world // (tp * pp), pp=pp, tp=tp, ep=ep, etp=lay["etp"], n_micro=pp,
                  virtual_stages=lay["virtual_stages"], schedule=lay["schedule"])


def check_replicas(slots: int, cfg, layout) -> None:
    """--expert-replicas on this layout, or ValueError (every rank alike, before any collective)."""
    if not slots:
        return
    E = cfg.n_expert
    if slots < 0 or not E or layout.ep < 2 or layout.tp > 1 or slots > E - E // layout.ep:
        raise ValueError(f"--expert-replicas {slots}: replicas copy whole experts over an ep group, so they need a MoE "
                         f"checkpoint, --ep 2 or more, --tp 1 and at most {E - E // max(layout.ep, 1)} slots "
                         f"(here n_expert={E}, ep={layout.ep}, tp={layout.tp})")


def place_once(model, mesh, comm, prompt, slots: int) -> list:
    """Collective: the prompt's prefill with the MoE layers counting their loads, the loads agreed over
    the world (every rank routed the same prompt: the mean is exact), and every MoE layer's replicas
    placed from them (parallel/replicas.py) -- once, for the whole generation. -> [(layer, the prompt's
    rows per rank max/mean without replicas, with them)] of this rank's layers."""
    from .nn.generate import decode
    from .parallel.generate import decoder_for
    from .parallel.replicas import max_over_mean, place_replicas, rank_loads

    layers = list(model.moe_layers())                    # (a model just built: its counters are zero)
    decode(decoder_for(model, mesh, prompt.shape[0]), prompt, 0)
    E = layers[0][1].n_expert if layers else 0
    vec = np.zeros((model.config.n_layer, E + 1), np.float64)  # host: over MPI; a rank fills its layers'
    for i, m in layers:                                  # loads and a 1 in the last column (it holds them)
        vec[i] = [*m.take_stats()["tokens_per_expert"], 1.0]
    total = np.asarray(comm.allreduce(vec.reshape(-1))).reshape(vec.shape)  # host
    out = []
    for i, m in layers:
        load = total[i, :E] / total[i, E]
        copies = place_replicas(load, mesh.ep, slots)
        m.expert_parallel.set_replicas(copies)
        out.append((i, max_over_mean(rank_loads(load, [[c[0]] for c in copies], mesh.ep)),
                    max_over_mean(rank_loads(load, copies, mesh.ep))))
    return out


def prompt_ids(a, V: int) -> list:
    """The prompt's token ids: --prompt-ids, or --prompt's UTF-8 bytes for the byte vocabulary."""
    if a.prompt_ids is not None:
        try:
            ids = [int(t) for t in a.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise ValueError(f"--prompt-ids {a.prompt_ids!r}: expected comma-separated integers") from None
    elif V == 256:
        if a.prompt == "":
            raise ValueError("--prompt is empty: give at least one character (the default is a newline)")
        ids = list(("\n" if a.prompt is None else a.prompt).encode("utf-8"))
    else:
        raise ValueError(f"the model's vocabulary has {V} tokens, not pympar's 256 bytes: give the prompt as "
                         f"--prompt-ids 1,2,3")
    if not ids or min(ids) < 0 or max(ids) >= V:
        raise ValueError(f"prompt ids must be 0..{V - 1} and at least one")
    return ids


def _error(e, mpi, rank) -> int:
    """One line on stderr (one write: the ranks' lines never interleave); exit status 2."""
    import os

    sys.stderr.flush()
    os.write(2, f"pympar.generate: error{'' if mpi is None else f' (rank {rank})'}: {e}\n".encode(errors="backslashreplace"))
    return 2


def main(argv=None) -> int:
    from .checkpoint import Checkpoint, CheckpointError

    env = start_application("pympar.generate", timed=True)
    a = build_parser().parse_args(argv)
    mpi = None
    if env.launched:                          # under an MPI launcher: MPI_Init, no collective yet
        from mpi4py import MPI
        mpi = MPI.COMM_WORLD if MPI.COMM_WORLD.Get_size() > 1 else None
    rank = 0 if mpi is None else mpi.Get_rank()
    try:                                      # every check on every rank, before any collective
        if a.tokens < 0 or not 0 < a.temperature < float("inf") or (a.top_k is not None and a.top_k < 1) or a.seed < 0:
            raise ValueError("--tokens must be >= 0, --temperature a finite number > 0, --top-k >= 1 and --seed >= 0")
        if a.prompt_ids is not None and a.prompt is not None:
            raise ValueError("give the prompt once: --prompt (text) or --prompt-ids (token ids), not both")
        if mpi is None:
            if any(getattr(a, k) not in (None, 1) for k in ("tp", "pp", "ep")) or a.expert_replicas:
                raise ValueError("--tp/--pp/--ep above 1 and --expert-replicas need that many ranks: launch with "
                                 "mpirun -n N")
            model, step = load_model(a.src)
            cfg = model.config
        else:
            from .layout import check

            if a.no_cache:
                raise ValueError("--no-cache runs on one process: launch without mpirun")
            ck = Checkpoint(a.src, verify=False)
            cfg = config_of(ck)
            layout = decode_layout(a, ck.meta, mpi.Get_size())
            check(cfg, layout)
            check_replicas(a.expert_replicas, cfg, layout)
        ids = prompt_ids(a, cfg.vocab_size)
    except (ValueError, OSError, CheckpointError) as e:
        return _error(e, mpi, rank)
    prompt = np.array([ids], np.int64)
    placed = None
    t0 = time.perf_counter()
    if mpi is None:
        from .nn.generate import generate

        bad = first_non_finite(model)
        if bad:
            return _error(ValueError(f"{a.src}: parameter {bad} holds non-finite values (NaN or inf): nothing to "
                                     f"sample from"), mpi, rank)

        out = generate(model, prompt, a.tokens, top_k=a.top_k, temperature=a.temperature,
                       rng=np.random.default_rng(a.seed), cache=not a.no_cache)
        how = "no cache" if a.no_cache else "key/value cache"
    else:
        from .checkpoint import restore_into
        from .comm import MPIComm
        from .parallel.cores import share_cores
        from .parallel.generate import build_for_generation, generate_parallel

        comm = MPIComm(mpi, name="world", on_timeout="abort")
        share_cores(comm, env.threads, env.threads_from)     # each rank its share of the node's cores
        model, mesh = build_for_generation(cfg, comm, layout)
        try:                                  # a damaged file found while loading: agreed on every rank
            step = int(restore_into(model, None, ck.path, comm).get("step", ck.step))
        except CheckpointError as e:
            return _error(e, mpi, rank)
        bad = first_non_finite(model)         # agreed: the ranks hold different parameters
        names = [n for n in mpi.allgather(bad) if n]
        if names:
            return _error(ValueError(f"{a.src}: parameter {names[0]} holds non-finite values (NaN or inf): nothing "
                                     f"to sample from"), mpi, rank)
        if a.expert_replicas:
            placed = place_once(model, mesh, comm, prompt, a.expert_replicas)
        out = generate_parallel(model, mesh, prompt, a.tokens, top_k=a.top_k, temperature=a.temperature,
                                rng=np.random.default_rng(a.seed))
        how = f"key/value cache, {mpi.Get_size()} ranks: tp={layout.tp} pp={layout.pp} ep={layout.ep} dp={layout.dp}" + \
            (f" etp={layout.etp}" if layout.folded else "")
    dt = time.perf_counter() - t0
    if rank == 0:
        new = out[0, len(ids):].tolist()
        if cfg.vocab_size == 256 and a.prompt_ids is None:
            sys.stdout.write(bytes(ids + new).decode("utf-8", errors="replace") + "\n")
        else:
            print(",".join(map(str, ids + new)))
        print(f"pympar.generate: {len(new)} tokens from step {step} in {dt:.2f} s ({len(new) / max(dt, 1e-9):,.0f} "
              f"tokens/s, {how})", file=sys.stderr)
        if placed:
            print("pympar.generate: replicas placed once from the prompt's loads, rows per ep rank max/mean "
                  + ", ".join(f"layer {i} {b:.2f} -> {r:.2f}" for i, b, r in placed), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
