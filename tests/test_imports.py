"""The package's import graph: imports point down the layers and no two files import each other.

Every import statement of every file under pympar/ counts -- at module level and inside
functions (a lazy import is still a dependency) -- read from the source, not by importing it.
The layers, lowest first (docs/design.md, "Layers"):

    csrc (pympar._C, pympar._cuda)  backend  kernels  comm  optim  nn  parallel  config/layout/plan  applications

A file may import its own layer and those below; the applications (train, launch, generate,
bench, the planner's command line plan.cli, checkpoint, data, metrics, profile, report, faults,
gpu) may import each other. The planner's package is the configuration layer (its cost model
chooses ``--layout auto``) except its command line.
"""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "src" / "pympar"
APPLICATION = 7
LAYERS = {"_C": -1, "_cuda": -1, "backend": 0, "kernels": 1, "comm": 2, "optim": 3, "nn": 4, "parallel": 5,
          "config": 6, "layout": 6, "plan": 6, "plan.cli": APPLICATION, "plan.__main__": APPLICATION}


def modules() -> dict:
    """Dotted module name -> its file, for every .py file of the package."""
    out = {}
    for f in PKG.rglob("*.py"):
        parts = ["pympar", *f.relative_to(PKG).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def layer(mod: str) -> int:
    parts = mod.split(".")
    if len(parts) == 1:
        return APPLICATION + 1                      # the package itself: above everything
    return LAYERS.get(".".join(parts[1:3]), LAYERS.get(parts[1], APPLICATION))


def imports(mods: dict) -> dict:
    """module -> {(imported module, line)}: the file each import statement reaches."""
    def extension(name):
        return name.split(".")[:2] in (["pympar", "_C"], ["pympar", "_cuda"])

    def resolve(name):
        if extension(name):
            return ".".join(name.split(".")[:2])   # the extension modules (csrc)
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges = {}
    for mod, f in mods.items():
        package = mod if f.name == "__init__.py" else mod.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    full = ".".join(base + ([node.module] if node.module else []))
                else:
                    full = node.module or ""
                # "from pkg import sub" reaches the file sub when it is one, else pkg itself
                targets = [f"{full}.{a.name}" if f"{full}.{a.name}" in mods or extension(f"{full}.{a.name}")
                           else full for a in node.names]
            for t in targets:
                if t == "pympar" or t.startswith("pympar."):
                    r = resolve(t)
                    if r and r != mod:
                        found.add((r, node.lineno))
        edges[mod] = found
    return edges


def cycles(edges: dict) -> list:
    """The strongly connected components of more than one file (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w, _ in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_walk_sees_lazy_imports_and_the_layers():
    """The walk itself: it finds imports inside functions and maps files to their layers (a walk
    that found nothing would pass the tests below)."""
    mods = modules()
    edges = imports(mods)
    assert len(mods) > 80
    assert "pympar._C" in {t for t, _ in edges["pympar.kernels.native"]}       # the extension, below kernels
    lazy = [n for n in ast.walk(ast.parse((PKG / "train.py").read_text()))
            if isinstance(n, ast.FunctionDef) and any(isinstance(x, (ast.Import, ast.ImportFrom)) for x in ast.walk(n))]
    assert lazy, "train.py has imports inside functions: the walk must count them"
    assert {t for t, _ in edges["pympar.train"]} >= {"pympar.config", "pympar.parallel.runner"}
    assert layer("pympar.comm.mpi") == 2 and layer("pympar.layout") == 6 and layer("pympar.train") == APPLICATION
    # a cycle and an upward import are found when they exist
    assert cycles({"a": {("b", 1)}, "b": {("a", 2)}, "c": set()}) == [["a", "b"]]


def test_no_import_cycle_between_files():
    found = cycles(imports(modules()))
    assert not found, f"import cycles between files (lazy imports included): {found}"


def test_imports_point_down_the_layers():
    edges = imports(modules())
    bad = [f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)}) at line {ln}"
           for m, ts in sorted(edges.items()) for t, ln in sorted(ts) if layer(t) > layer(m)]
    assert not bad, "imports that point up the layers:\n" + "\n".join(bad)


_IMPORT_COST = """
import sys, time
t = time.process_time()
import numpy
numpy_s = time.process_time() - t
if sys.argv[1] == "pympar.train":
    import pympar.train
print(time.process_time() - t, numpy_s, " ".join(sorted(m for m in ("ml_dtypes", "torch", "matplotlib", "scipy",
                                                                   "transformers", "cupy") if m in sys.modules)))
"""


def test_importing_the_trainer_costs_a_small_multiple_of_numpy():
    """Every rank imports pympar.train: 32 ranks on 2 cores pay it 32 times. Measured here: numpy 0.09 s
    of CPU, pympar.train (numpy included) 0.38 s; with ml_dtypes 0.7.0 imported eagerly it was 1.3 s
    (its import alone 1.0 s). The bound, 8x numpy's own import, leaves room for a slower machine's noise
    (the best of three runs each) and fails on that eager import. The heavy optional packages are not
    imported at all by a float32 run's code path (checked by name: no timing involved)."""
    import subprocess
    import sys

    def cost(what):
        runs = [subprocess.run([sys.executable, "-c", _IMPORT_COST, what], capture_output=True, text=True,
                               timeout=120, check=True).stdout.split() for _ in range(3)]
        return min(float(r[0]) for r in runs), min(float(r[1]) for r in runs), set(runs[0][2:])

    total, numpy_s, heavy = cost("pympar.train")
    assert not heavy, f"import pympar.train imports {sorted(heavy)}: import them where a run needs them"
    assert total < 8 * max(numpy_s, 0.02), f"import pympar.train took {total:.2f} s of CPU, numpy {numpy_s:.2f} s"


def test_composition_declares_its_hooks_no_class_swaps_or_attribute_walks():
    """The parallel strategies attach to what the modules declare (nn.MoE.expert_parallel,
    AttentionModule.core): no file of the package assigns an object's ``__class__`` or walks
    another object's attributes with ``vars(x)`` (a module's own ``vars(self)`` is its children)."""
    bad = []
    for mod, f in modules().items():
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == "__class__"
                                                    for t in node.targets):
                bad.append(f"{mod}:{node.lineno} assigns __class__")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars"
                    and node.args and not (isinstance(node.args[0], ast.Name) and node.args[0].id == "self")
                    and not isinstance(node.args[0], (ast.Call,))):
                bad.append(f"{mod}:{node.lineno} vars({ast.unparse(node.args[0])})")
    assert not bad, bad
