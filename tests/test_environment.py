"""The environment is read in one module, pympar/config.py, and handed down as parameters.

A walk over the package's source finds every use of ``os.environ`` and ``os.getenv`` (and of
``getenv`` in the C++ sources); outside config.py the only one allowed is passing the whole
environment on to a child process (``dict(os.environ, ...)``), which reads no setting.
"""
from __future__ import annotations

import ast
import math
import subprocess
import sys
from pathlib import Path

import pytest

from pympar import config, kernels
from pympar.comm import settings as comm_settings
from pympar.config import ConfigError, apply_environment, read_environment
from pympar.kernels import blas

ROOT = Path(__file__).resolve().parent.parent
EDGE = ROOT / "src" / "pympar" / "config.py"


def environment_reads(path: Path) -> list:
    """(line, what) for each read of the environment in a Python file."""
    tree = ast.parse(path.read_text(), str(path))
    passed_on = set()                   # os.environ nodes that are dict(os.environ, ...)'s first argument
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict" and node.args:
            passed_on.add(id(node.args[0]))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb") \
                and isinstance(node.value, ast.Name) and node.value.id == "os" and id(node) not in passed_on:
            out.append((node.lineno, f"os.{node.attr}"))
        if isinstance(node, ast.ImportFrom) and node.module == "os" and \
                any(a.name in ("environ", "getenv", "environb") for a in node.names):
            out.append((node.lineno, "from os import environ/getenv"))
    return sorted(out)


def test_the_walk_finds_reads():
    """The detector itself, on a file that reads the environment three ways and passes it once."""
    src = ("import os\nfrom os import getenv\na = os.environ.get('X')\nb = os.getenv('Y')\n"
           "c = 'Z' in os.environ\nd = dict(os.environ, W='1')\n")
    f = Path(__file__).with_name("_env_probe.txt")
    try:
        f.write_text(src)
        found = environment_reads(f)
    finally:
        f.unlink()
    assert [ln for ln, _ in found] == [2, 3, 4, 5]


def test_only_the_configuration_edge_reads_the_environment():
    bad = [f"{p.relative_to(ROOT)}:{ln}: {what}" for p in sorted((ROOT / "src" / "pympar").rglob("*.py")) if p != EDGE
           for ln, what in environment_reads(p)]
    assert not bad, "the environment is read outside pympar/config.py:\n" + "\n".join(bad)
    assert environment_reads(EDGE), "config.py reads the environment (the walk sees it)"


def test_the_native_sources_read_no_environment():
    bad = [f"{p.relative_to(ROOT)}:{i + 1}" for p in sorted((ROOT / "csrc").rglob("*"))
           if p.suffix in (".cpp", ".h", ".cu", ".cuh")
           for i, line in enumerate(p.read_text().splitlines()) if "getenv" in line]
    assert not bad, f"getenv in the C++/CUDA sources (read at pympar/config.py instead): {bad}"


def test_every_variable_read_is_in_the_table():
    """Each PYMPAR_* name config.py reads is documented in config.ENVIRONMENT (and in docs/engine.md)."""
    import re

    text = EDGE.read_text()
    read = set(re.findall(r'"(PYMPAR_[A-Z_]+)"', text))
    documented = {n.strip() for k in config.ENVIRONMENT for n in k.split(",")}
    assert read <= documented, read - documented
    doc = (ROOT / "docs" / "engine.md").read_text()
    missing = sorted(n for n in documented if n.startswith("PYMPAR_") and n not in doc)
    assert not missing, f"docs/engine.md's table lacks {missing}"


@pytest.mark.parametrize("env, match", [
    ({"PYMPAR_NUM_THREADS": "two"}, "PYMPAR_NUM_THREADS='two' is not a number of threads"),
    ({"PYMPAR_COMM_TIMEOUT": "soon"}, "PYMPAR_COMM_TIMEOUT='soon' is not a number of seconds"),
    ({"PYMPAR_PP_CHANNELS": "2"}, r"PYMPAR_PP_CHANNELS='2': expected 0 \(MPI with tags\), 1 \(ordered channels\)"),
    ({"PYMPAR_SHM_CHUNK": "8"}, "PYMPAR_SHM_CHUNK='8' must be at least 64"),
    ({"PYMPAR_KERNELS": "fast"}, "PYMPAR_KERNELS='fast': expected one of"),
    ({"PYMPAR_RANKS_PER_NODE": "0"}, "PYMPAR_RANKS_PER_NODE='0' must be at least 1"),
])
def test_malformed_values_are_refused_naming_the_variable(env, match):
    with pytest.raises(ConfigError, match=match):
        read_environment(env)


def test_values_are_parsed():
    e = read_environment({"OMP_NUM_THREADS": "3", "PYMPAR_COMM_TIMEOUT": "0", "PYMPAR_PP_CHANNELS": "1",
                          "PYMPAR_CUDA_AWARE_MPI": "yes", "MPI_LOCALNRANKS": "4", "SLURM_LOCALID": "2",
                          "PMI_RANK": "0", "PYMPAR_CACHE": "/tmp/c"})
    assert (e.threads, e.threads_from, e.comm_timeout, e.pp_channels) == (3, "OMP_NUM_THREADS", 0.0, "1")
    assert (e.cuda_aware_mpi, e.launcher_local_ranks, e.local_rank, e.launched, e.cache_dir) == (True, 4, 2, True, "/tmp/c")
    blank = read_environment({})
    assert (blank.threads, blank.comm_timeout, blank.cuda_aware_mpi, blank.launched) == (0, None, None, False)


def test_apply_hands_the_settings_down():
    before = (kernels._forced_reference(), dict(blas._allowed), comm_settings.SETTINGS.timeout,
              comm_settings.SETTINGS.debug_collectives, comm_settings.SETTINGS.shm_chunk)
    try:
        apply_environment({"PYMPAR_KERNELS": "reference", "PYMPAR_CHUNK_THREADS": "0", "PYMPAR_COMM_TIMEOUT": "-1",
                           "PYMPAR_DEBUG_COLLECTIVES": "1", "PYMPAR_SHM_CHUNK": "4096", "PYMPAR_MALLOC": "system"})
        assert kernels._forced_reference() and not blas._allowed["chunks"] and blas._allowed["share"]
        s = comm_settings.SETTINGS
        assert s.timeout == math.inf and s.debug_collectives and s.shm_chunk == 4096
    finally:
        kernels.use_reference(before[0])
        blas.configure(share_threads=before[1]["share"], chunk_threads=before[1]["chunks"])
        comm_settings.configure(timeout=before[2], debug_collectives=before[3], shm_chunk=before[4])


def test_a_program_of_its_own_is_not_steered_by_the_environment():
    """Without apply_environment (a program that imports pympar itself), PYMPAR_* change nothing."""
    code = ("import pympar.kernels as k, pympar.comm.settings as s\n"
            "print(k._forced_reference(), s.SETTINGS.timeout)\n"
            "import pympar.config as c; c.apply_environment()\n"
            "print(k._forced_reference(), s.SETTINGS.timeout)\n")
    env = dict(config.child_environment(PYMPAR_KERNELS="reference", PYMPAR_COMM_TIMEOUT="7"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split("\n")[:2] == ["False 300.0", "True 7.0"]
