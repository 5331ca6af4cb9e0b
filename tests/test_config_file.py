"""The --config TOML file's values are checked as their flags are: the field's type (int, float,
bool, str), its choices, finite floats; a wrong one is one error line naming the file, the key and
the value, on every rank, exit status 2, before anything else runs."""
import pytest

from mpirun import run_mpi
from pympar.config import ConfigError, parse_args


def _parse(tmp_path, text, *flags, world=1):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p, parse_args(["--config", str(p), *flags], world_size=world)


@pytest.mark.parametrize("text, message", [
    # int: a TOML integer, not a float, a string, a boolean, an array or a date
    ("sample_tokens = 2.5", "sample_tokens = 2.5: must be an integer"),
    ("sample_top_k = 1.5", "sample_top_k = 1.5: must be an integer"),
    ("keep = 1.5", "keep = 1.5: must be an integer"),
    ('steps = "5"', 'steps = "5": must be an integer'),
    ("steps = 5.0", "steps = 5.0: must be an integer"),
    ("steps = [5]", "steps = [5]: must be an integer"),
    ("steps = 1979-05-27", "steps = 1979-05-27: must be an integer"),
    ("steps = true", "steps = true: must be an integer"),
    ('seed = "1"', 'seed = "1": must be an integer'),
    ("n_head = 2.0", "n_head = 2.0: must be an integer"),
    ('[parallel]\nmicro_batch_size = "4"', 'micro_batch_size = "4": must be an integer'),   # in a table too
    # float: an integer or a float, not a string or a boolean; finite (NaN never)
    ('lr = "x"', 'lr = "x": must be a number'),
    ("topk_ratio = true", "topk_ratio = true: must be a number"),
    ("ln_eps = nan", "ln_eps = nan: must be a finite number"),
    ("lr = nan", "lr = nan: must be a finite number"),
    ("capacity_factor = -nan", "capacity_factor = nan: must be a finite number"),
    ("bucket_mb = inf", "bucket_mb = inf: must be a finite number"),
    ("comm_timeout = nan", "comm_timeout = nan: must be a number or inf (inf: no time-out)"),
    # bool: a TOML boolean only
    ('bias = "no"', 'bias = "no": must be true or false'),
    ('deterministic = "no"', 'deterministic = "no": must be true or false'),
    ('dp_overlap = "no"', 'dp_overlap = "no": must be true or false'),
    ("profile = 0", "profile = 0: must be true or false"),
    # str: a string
    ("out = 3", "out = 3: must be a string"),
    ('data = ["a.txt"]', 'data = ["a.txt"]: must be a string'),
    # choices: one of the flag's
    ('compress = "zip"', 'compress = "zip": must be one of "none", "fp16", "bf16", "topk"'),
    ("compress = 1", 'compress = 1: must be a string (one of "none", "fp16", "bf16", "topk")'),
    ("zero = 5", "zero = 5: must be one of 0, 1, 2, 3"),
    ("zero = true", "zero = true: must be an integer (one of 0, 1, 2, 3)"),
    ("zero = 1.0", "zero = 1.0: must be an integer (one of 0, 1, 2, 3)"),
    # optional fields (default None): their type
    ('etp = "1"', 'etp = "1": must be an integer'),
    ('dp = "2"', 'dp = "2": must be an integer'),
    ("resume = false", "resume = false: must be a string"),
])
def test_a_wrong_value_is_one_line_naming_file_key_and_value(tmp_path, text, message):
    p = tmp_path / "c.toml"
    with pytest.raises(ConfigError) as e:
        _parse(tmp_path, text + "\n")
    assert str(e.value) == f"{p}: {message}"


def test_right_values_are_taken_as_the_flags_give_them(tmp_path):
    _, c = _parse(tmp_path, "lr = 1\ncapacity_factor = 2\ncomm_timeout = inf\nbias = false\nzero = 1\netp = 1\n"
                  'compress = "bf16"\nout = "o"\n[model]\nln_eps = 1e-6\n', "--preset", "moe-tiny", world=2)
    assert (c.optim.lr, c.model.capacity_factor, c.run.comm_timeout) == (1.0, 2.0, float("inf"))
    assert all(type(x) is float for x in (c.optim.lr, c.model.capacity_factor, c.model.ln_eps))
    assert (c.model.bias, c.parallel.zero, c.parallel.etp, c.run.compress, c.run.out) == (False, 1, 1, "bf16", "o")


def test_a_flag_does_not_excuse_a_wrong_value_in_the_file(tmp_path):
    """The file is checked whole, before the flags override it: a wrong file is wrong."""
    with pytest.raises(ConfigError, match=r"steps = 2\.5: must be an integer"):
        _parse(tmp_path, "steps = 2.5\n", "--steps", "3")


@pytest.mark.parametrize("text, flag, message", [
    ("seed = -1", ["--seed", "-1"], "seed=-1 must be >= 0"),
    ("eval_iters = 0", ["--eval-iters", "0"], "eval_iters=0 must be >= 1"),
    ("topk_ratio = 2", ["--topk-ratio", "2"], r"topk_ratio=2.0 must be in \(0, 1\]"),
    ("micro_batch_size = 0", ["--micro-batch-size", "0"], "micro_batch_size=0 must be >= 1"),
    ("ln_eps = 0", ["--ln-eps", "0"], "ln_eps=0.0 must be > 0"),
])
def test_the_flags_ranges_apply_to_the_file(tmp_path, text, flag, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(flag, world_size=1)
    with pytest.raises(ConfigError, match=message):
        _parse(tmp_path, text + "\n")


def test_every_rank_says_it_once_and_exits_2(tmp_path):
    """sample_tokens = 2.5 used to train every step and then die in sampling with a traceback."""
    p = tmp_path / "c.toml"
    p.write_text("steps = 2\neval_iters = 1\nsample_tokens = 2.5\n")
    res = run_mpi(2, ["-m", "pympar.train", "--config", str(p), "--preset", "tiny", "--block-size", "16",
                      "--micro-batch-size", "2", "--out", str(tmp_path / "o")], check=False, timeout=60)
    lines = [line for line in res.stdout.splitlines() if line.startswith("pympar.train: error:")]
    assert res.returncode == 2, res.stdout[-3000:]
    assert lines == [f"pympar.train: error: {p}: sample_tokens = 2.5: must be an integer"] * 2, res.stdout[-3000:]
    assert "Traceback" not in res.stdout and not (tmp_path / "o" / "metrics.jsonl").exists()


def test_a_pipe_given_as_the_file_is_refused_not_read(tmp_path):
    """Reading a named pipe would wait for a writer forever, on every rank."""
    import os
    p = tmp_path / "c.toml"
    os.mkfifo(p)
    with pytest.raises(ConfigError, match="not a regular file"):
        parse_args(["--config", str(p)], world_size=1)
