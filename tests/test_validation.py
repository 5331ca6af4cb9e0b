"""Every invalid configuration stops ALL ranks of an mpiexec job, before any collective, with
the same one-line message and status 2 -- never a hang (each launch has a bounded timeout)."""
import os

import numpy as np
import pytest

from mpirun import run_mpi

N = 2
SMALL = ["--n-layer", "2", "--n-embd", "16", "--n-head", "2", "--block-size", "16", "--micro-batch-size", "2",
         "--eval-iters", "1", "--sample-tokens", "0", "--steps", "2"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("val")
    (d / "text.txt").write_text("hello world, this is a small corpus of text. " * 400)
    (d / "binary.txt").write_bytes(b"abc\0def" * 100)
    (d / "empty.txt").write_bytes(b"")
    (d / "bad.bin").write_bytes(b"\1\2\3\4" * 400)
    (d / "run.toml").write_text("micro_batch_size = [\n")
    header = np.zeros(256, "<i4")
    header[:3] = (20240520, 1, 1)                 # llm.c: magic, version 1 (uint16), one token
    (d / "one.bin").write_bytes(header.tobytes() + np.array([7], "<u2").tobytes())
    (d / "pipes").mkdir()
    for name in ("train.bin", "val.bin"):        # named pipes: opening one would wait for a writer
        os.mkfifo(d / "pipes" / name)
    return d


CASES = [  # (id, args, expected substring of the message, env)
    ("world", ["--dp", "3"], "does not match the world size 2", None),
    ("ep-dp", ["--dp", "2", "--ep", "4", "--n-expert", "4"], "ep=4 does not divide dp=2", None),
    ("ep-experts", ["--dp", "2", "--ep", "2", "--n-expert", "3"], "n_expert=3 is not divisible by ep=2", None),
    ("heads-tp", ["--tp", "2", "--n-head", "3", "--n-embd", "24"], "n_head=3 is not divisible by tp=2", None),
    ("width-heads", ["--n-embd", "15"], "n_embd", None),
    ("layers-pp", ["--pp", "2", "--n-layer", "1"], "pp=2 is more than n_layer=1", None),
    ("micro-batch", ["--micro-batch-size", "0"], "micro_batch_size=0 must be >= 1", None),
    ("n-micro", ["--n-micro", "0"], "n_micro=0 must be >= 1", None),
    ("preset", ["--preset", "gigantic"], "invalid choice: 'gigantic'", None),
    ("dtype", ["--dtype", "float8"], "invalid choice: 'float8'", None),
    ("flag", ["--no-such-flag", "1"], "unrecognized arguments: --no-such-flag", None),
    ("int-value", ["--steps", "many"], "invalid int value: 'many'", None),
    ("data-missing", ["--data", "/nonexistent/corpus.txt"], "no such file or directory", None),
    ("data-binary", ["--data", "{d}/binary.txt"], "looks binary", None),
    ("data-empty", ["--data", "{d}/empty.txt"], "empty", None),
    ("data-llmc", ["--data", "{d}/bad.bin"], "magic", None),
    ("toml", ["--config", "{d}/run.toml"], "not valid TOML", None),
    ("resume-missing", ["--resume", "{d}/no-such-checkpoint"], "does not exist (expected a run directory, its checkpoints/ folder or one step_N checkpoint)", None),
    ("resume-not-ckpt", ["--resume", "{d}"], "not a checkpoint", None),
    ("resume-auto-no-out", ["--resume", "auto"], "--resume auto needs --out", None),
    ("save-no-out", ["--save-every", "2"], "--save-every 2 needs --out", None),
    ("timeout", ["--comm-timeout", "0"], "comm_timeout=0.0 must be > 0", None),
    ("timeout-env", [], "PYMPAR_COMM_TIMEOUT='soon' is not a number", {"PYMPAR_COMM_TIMEOUT": "soon"}),
    ("pp-costs-1f1b", ["--pp", "2", "--pp-costs", "measured"],
     "--pp-costs measured builds the zb-h1/zb-v table for the measured times, but this run is pp=2 with schedule 1f1b", None),
    ("threads-over-pool", ["--threads", "256"], "threads=256 (--threads) is more than the C++ kernel pool's 255", None),
    # before every loop over the layers (a trillion of them spun every rank, before any timeout)
    ("layers-bound", ["--n-layer", "1000000000000"], "n_layer=1000000000000 must be <= 100000", None),
    ("ln-eps-nan", ["--ln-eps", "nan"], "ln_eps=nan must be a finite number", None),
    ("data-fifo", ["--data", "{d}/pipes"], "train.bin: not a regular file", None),
    ("data-one-token", ["--data", "{d}/one.bin"], "0 training and 1 validation tokens: too few", None),
    # a file name that is not UTF-8 (byte 0xff): the error line escapes it instead of failing to print
    ("resume-undecodable", ["--resume", "/nonexistent/\udcffnope"], "/nonexistent/\\udcffnope: does not exist", None),
]


@pytest.mark.parametrize("args,want,env", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_invalid_configuration_stops_every_rank_with_one_message(files, args, want, env):
    args = [a.format(d=files) for a in args]
    data = [] if "--data" in args else ["--data", str(files / "text.txt")]
    p = run_mpi(N, ["-m", "pympar.train", *SMALL, *data, *args], timeout=60, env=env, check=False)
    assert p.returncode == 2, p.stdout[-3000:]
    errs = [ln for ln in p.stdout.splitlines() if ln.startswith("pympar.train: error: ")]
    assert len(errs) == N, p.stdout[-3000:]            # every rank says it
    assert len(set(errs)) == 1, errs                    # the same words on every rank
    assert want in errs[0], errs[0]
    assert "step 1/" not in p.stdout                    # no training started
