"""The native build: when a compiled pympar._C sits in the package, it must be the one in use,
expose every kernel of the contract, and pick the best instruction-set build for this CPU.
(That the CUDA sources compile wherever nvcc exists is checked by CI's build itself.)"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pympar
import pympar.kernels as K
from pympar.kernels import reference

PKG = Path(pympar.__file__).resolve().parent
ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.find_spec("pympar._C")   # beside the package, or where an editable install put it
built = [Path(_spec.origin)] if _spec is not None and _spec.origin else []


@pytest.mark.skipif(not built, reason="pympar._C is not built (pure-reference install)")
def test_built_module_is_the_one_in_use():
    assert K.native_available(), f"{built[0].name} exists but pympar._C did not import"
    assert K.backend(__import__("numpy").zeros(1)) == "cpp"
    from pympar import _C

    assert Path(_C.__file__).resolve() == built[0].resolve()


def test_the_checkout_cannot_shadow_the_installed_package():
    """The src/ layout: the repository's root holds no importable pympar, so `python -m pympar.train`
    typed there (the README's first command) imports the installed package, native module and all."""
    assert not (ROOT / "pympar").exists() and (ROOT / "src" / "pympar" / "__init__.py").exists()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", "import pympar.kernels as k; print(k.native_available(), k.describe())"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.split()[0] == str(K.native_available()), out
    if built:
        assert out.startswith("True C++ "), out


@pytest.mark.skipif(not built, reason="pympar._C is not built")
def test_every_contract_kernel_is_bound():
    from pympar import _C

    kernels = [n for n in dir(reference) if not n.startswith("_") and callable(getattr(reference, n))
               and getattr(reference, n).__module__ == reference.__name__]
    missing = [n for n in kernels if not hasattr(_C, n)]
    assert not missing, f"pympar._C lacks {missing}"


@pytest.mark.skipif(not built, reason="pympar._C is not built")
def test_best_isa_for_this_cpu():
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    if {"avx512f", "avx512bw", "avx512dq", "avx512vl", "fma", "f16c"} <= flags:
        want = "avx512"
    elif {"avx2", "fma", "f16c"} <= flags:
        want = "avx2"
    else:
        want = "generic"
    import os

    if os.environ.get("PYMPAR_ISA"):
        pytest.skip("PYMPAR_ISA forces a build")
    assert K.native_isa() == want


def test_tests_import_the_package_that_was_built():
    """pip installed a pympar with a native module, but the tests import another copy without one
    (e.g. `python -m pytest` from the repository root puts the source tree first on sys.path):
    every native test would skip silently."""
    from importlib import metadata

    try:
        dist = metadata.distribution("pympar")
    except metadata.PackageNotFoundError:
        pytest.skip("pympar is not pip-installed (source tree in use)")
    installed = [f for f in (dist.files or []) if f.name.startswith("_C.") and f.suffix in (".so", ".pyd")]
    if not installed:
        pytest.skip("the installed pympar has no native module")
    where = Path(dist.locate_file(installed[0])).resolve().parent
    assert K.native_available(), (
        f"pympar imported from {PKG} has no pympar._C, but the installed one in {where} has: run the tests "
        f"with the installed package first on sys.path (`pytest`, not `python -m pytest`, from the repository "
        f"root), or install the checkout for development with pip install -e .")


def test_headers_shared_by_the_isa_builds_define_only_internal_functions():
    """csrc/math.cpp, elementwise.cpp, attention.cpp and table.cpp are compiled once per
    instruction set (generic, avx2, avx512) into one module. A function an included header defines
    `inline` at namespace scope is ONE function to the linker, so an -O0 or LTO build could call the
    AVX-512 copy on an AVX2 machine: the shared headers define theirs `static` (one copy per
    translation unit, compiled with that unit's flags) or inside the per-ISA namespace."""
    import re

    root = Path(__file__).resolve().parent.parent / "csrc"
    cmake = (root.parent / "CMakeLists.txt").read_text()
    sources = re.search(r"set\(PYMPAR_ISA_SOURCES ([^)]*)\)", cmake).group(1).split()
    headers, todo = set(), [root.parent / s for s in sources]
    while todo:                                   # the headers the ISA sources include, transitively
        for inc in re.findall(r'#include "([^"]+)"', todo.pop().read_text()):
            if inc not in headers and (root / inc).is_file():
                headers.add(inc)
                todo.append(root / inc)
    assert {"fastmath.h", "dtypes.h", "isa.h"} <= headers, headers
    bad = []
    for name in sorted(headers):
        text = (root / name).read_text()
        isa_scoped = "namespace PYMPAR_ISA" in text
        for n, line in enumerate(text.splitlines(), 1):
            if re.match(r"\s*(template\s*<[^>]*>\s*)?(?!static\b)(\w+\s+)?inline\s", line) and not isa_scoped:
                bad.append(f"{name}:{n}: {line.strip()}")
    assert not bad, "external inline functions in headers the ISA builds share:\n" + "\n".join(bad)
