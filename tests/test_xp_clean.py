"""Static check: the modules the GPU path runs never call a NumPy array function where the
operand may be a CuPy array (that would raise, or silently copy to the host).

Scope: the forward/backward/step functions of pympar.nn, pympar.optim and the data-parallel
sync (dp, gradsync, zero) -- what `--device cuda` executes. A call counts when it is
``np.<f>(...)`` (or ``np.<f>.at``) with f in ARRAY_FUNCS; NumPy dtypes and functions of host
scalars (np.sqrt(head_size)) are not array operations and are not listed. Code that must
stay on the host (sampling in GPT.generate, state_dict copies, configuration) is outside the
scanned functions; a line that builds a host vector on purpose (a count for an MPI
allreduce) says so with a ``# host`` comment.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "src" / "pympar"
FILES = sorted((ROOT / "nn").glob("*.py")) + sorted((ROOT / "optim").glob("*.py")) + \
    [ROOT / "parallel" / f for f in ("dp.py", "gradsync.py", "zero.py")]
# the model-parallel strategies run whole on the device: every function in them is scanned
EVERY_FUNCTION = sorted((ROOT / "parallel" / "tp").glob("*.py")) + sorted((ROOT / "parallel" / "pp").glob("*.py")) + \
    [ROOT / "parallel" / f for f in ("ep.py", "runner.py", "compress.py")]
HOT = {"forward", "backward", "step", "run_experts", "run_experts_backward", "loss_and_grad", "forward_loss",
       "logits", "matmul", "accumulate", "compute_cast", "clip_grad_norm", "found_inf", "update_expert_bias",
       "take_stats", "local_sq", "nonfinite", "scale_grads", "gather_grads", "_complete",
       "_start", "_head_forward", "_forward", "_inputs", "sum_sq", "host_scalars", "zero_grad", "__init__"}
ARRAY_FUNCS = {"zeros", "zeros_like", "empty", "empty_like", "ones", "ones_like", "full", "full_like", "asarray",
               "array", "ascontiguousarray", "add", "put_along_axis", "take_along_axis", "einsum", "exp", "log",
               "tile", "arange", "bincount", "flatnonzero", "argsort", "sort", "concatenate", "stack", "where",
               "dot", "matmul", "isfinite", "sign", "maximum", "minimum", "sum", "mean", "abs", "copyto", "cumsum",
               "split", "array_split", "unique", "repeat", "searchsorted", "ix_", "vdot",
               "argmax", "max", "min", "clip", "nonzero", "count_nonzero", "isin", "all", "any"}
# constructors that only ever see host data (initial values are built on the host, then moved)
ALLOWED = {("parameter.py", "init_param"), ("moe.py", "__init__"), ("layers.py", "__init__"),
           ("gpt.py", "__init__"), ("attention.py", "__init__"), ("adamw.py", "__init__"),
           ("dp.py", "__init__"), ("gradsync.py", "__init__"), ("zero.py", "__init__")}


def violations(path: Path, every=False):
    src = path.read_text()
    lines = src.splitlines()
    tree = ast.parse(src)
    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or not (every or fn.name in HOT):
            continue
        if (path.name, fn.name) in ALLOWED:
            continue
        for node in ast.walk(fn):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr == "at":   # np.add.at(...)
                f = f.value
            if (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "np"
                    and f.attr in ARRAY_FUNCS and "# host" not in lines[node.lineno - 1]):
                out.append(f"{path.name}:{node.lineno} {fn.name}: np.{f.attr}(...)")
    return out


@pytest.mark.parametrize("path", FILES + EVERY_FUNCTION, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_numpy_array_calls_on_the_gpu_path(path):
    bad = violations(path, every=path in EVERY_FUNCTION)
    assert not bad, "use xp = backend.xp_of(array) instead:\n" + "\n".join(bad)


def test_the_checker_catches_a_numpy_call(tmp_path):
    p = tmp_path / "mod.py"
    p.write_text("import numpy as np\nclass L:\n    def backward(self, dy):\n        np.add.at(dy, [0], 1)\n"
                 "        return np.zeros_like(dy)\n")
    assert len(violations(p)) == 2
    p.write_text("import numpy as np\ndef step(c):\n    return np.asarray(c.allreduce(np.array([1.0])))  # host\n")
    assert violations(p) == []
