#!/usr/bin/env bash
# The prepared GPU check: run ONCE on a GPU machine (e.g. one H200), blind, from a copy of the
# repo tree, with no network. It never stops at the first failure: each stage has a hard
# timeout, its outcome goes into JSON, and the whole run ends inside ~290 s.
#
#   bash bench/gpu_check.sh                 # results in $OUT (if set) else ./gpu_results
#   PYTHON=/path/to/python bash bench/gpu_check.sh
#
# Stages: env (python, numpy, cupy, mpi4py, torch, nvcc, GPU) -> install fallback when CuPy or
# mpi4py is missing (wheels carried in .whl/, then a venv with `pip install -e .[cuda12]`, which
# fails cleanly offline) -> build pympar._C and pympar._cuda for this GPU's architecture ->
# the gpu-marked tests -> bench/gpu_bench.py (kernels vs CuPy expressions, a training step vs
# PyTorch, MFU) -> pp/tp/ep layouts on the GPU under mpiexec. Output: gpu_check.json (the summary:
# environment, stage exit codes and times, test counts and failures, the benchmark), run.log,
# env.json, build.log, tests.log, bench.log, layouts.log, nvidia-smi.txt.
set -u
cd "$(dirname "$0")/.."
ROOT=$(pwd)
DEST=${OUT:-$ROOT/gpu_results}      # gets at most 8 files: gpu_check.json + logs (see the end)
mkdir -p "$DEST"
RES=$(mktemp -d /tmp/pympar_gpu_check.XXXXXX)   # every intermediate file
T0=$(date +%s)
DEADLINE=${GPU_CHECK_SECONDS:-290}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
# the package is assembled in $TREE: src/pympar plus the modules step 3 builds for this GPU
TREE=/tmp/pympar-gpu-tree
export PYTHONPATH="$TREE${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null 2>&1 || PY=python

left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
cap() {  # cap SECONDS: the smaller of SECONDS and the time left (at least 5)
  local l; l=$(left); [ "$l" -lt "$1" ] && echo $(( l > 5 ? l : 5 )) || echo "$1"
}
declare -A STATUS
stage() {  # stage NAME SECONDS LOG cmd...: run with a hard timeout, record the exit status
  local name=$1 secs; secs=$(cap "$2"); local log=$3; shift 3
  local t=$(date +%s)
  echo "== $name (timeout ${secs}s)" | tee -a "$RES/run.log"
  timeout -k 5 "$secs" "$@" >"$log" 2>&1
  local rc=$?
  STATUS[$name]="{\"rc\": $rc, \"seconds\": $(( $(date +%s) - t )), \"timed_out\": $([ $rc -eq 124 ] || [ $rc -eq 137 ] && echo true || echo false)}"
  echo "   rc=$rc ($(( $(date +%s) - t )) s)" | tee -a "$RES/run.log"
  tail -n 5 "$log" | sed 's/^/   | /' | tee -a "$RES/run.log"
  return $rc
}

# --- 1. environment ---------------------------------------------------------------------------
PROBE=$(mktemp /tmp/pympar_probe.XXXXXX.py)
cat >"$PROBE" <<'EOF'
import importlib, json, platform, shutil, subprocess, sys
out = {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform()}
for mod in ("numpy", "cupy", "mpi4py", "ml_dtypes", "tqdm", "pytest", "pytest_timeout", "torch", "pybind11",
            "scikit_build_core", "cmake", "ninja"):
    try:
        m = importlib.import_module(mod)
        out[mod] = getattr(m, "__version__", "present")
    except Exception as e:
        out[mod] = f"MISSING ({type(e).__name__}: {e})"[:200]
try:
    import cupy
    out["gpu_count"] = cupy.cuda.runtime.getDeviceCount()
    p = cupy.cuda.runtime.getDeviceProperties(0)
    out["gpu_name"] = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
    out["compute_capability"] = f"{p['major']}{p['minor']}"
except Exception as e:
    out["gpu_error"] = f"{type(e).__name__}: {e}"[:300]
try:
    from mpi4py import MPI
    out["mpi_library"] = MPI.Get_library_version().splitlines()[0][:200]
except Exception as e:
    out["mpi_error"] = f"{type(e).__name__}: {e}"[:300]
try:
    import torch
    out["torch_cuda"] = torch.cuda.is_available()
except Exception:
    pass
for tool in ("nvcc", "nvidia-smi", "mpiexec", "cmake", "ninja"):
    out[f"which_{tool}"] = shutil.which(tool)
if shutil.which("nvcc"):
    out["nvcc"] = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
print(json.dumps(out, indent=1))
EOF
stage env 40 "$RES/env.json" "$PY" "$PROBE"
nvidia-smi >"$RES/nvidia-smi.txt" 2>&1 || true

# --- 2. install fallback (only when CuPy or mpi4py does not import) ---------------------------
need_install() { ! "$PY" -c "import cupy, mpi4py, ml_dtypes" >/dev/null 2>&1; }
if need_install; then
  if ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
    stage install_wheels 60 "$RES/install.log" "$PY" -m pip install -q --no-index --no-deps --no-compile \
      --target /tmp/pympar-site "$ROOT"/.whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/pympar-site"
  fi
  if need_install; then   # the packaged way; offline it fails fast, and the failure is recorded
    stage install_venv 60 "$RES/install_venv.log" bash -c "'$PY' -m venv --system-site-packages /tmp/pympar-venv && \
      PIP_DEFAULT_TIMEOUT=5 /tmp/pympar-venv/bin/pip install --retries 0 -e '.[cuda12]'" \
      && PY=/tmp/pympar-venv/bin/python
  fi
fi

# --- 3. build the native modules for this Python and this GPU ---------------------------------
CC_CAP=$("$PY" -c "import cupy; p = cupy.cuda.runtime.getDeviceProperties(0); print(f\"{p['major']}{p['minor']}\")" 2>/dev/null || echo 90)
export CUDAARCHS=$CC_CAP
if [ "${GPU_CHECK_SKIP_BUILD:-0}" = 1 ]; then   # (dry runs on a machine without a GPU)
  echo "build skipped (GPU_CHECK_SKIP_BUILD=1)" >"$RES/build.log"
else
  stage build 150 "$RES/build.log" bash -c "cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DPython_EXECUTABLE='$PY' -Dpybind11_DIR=\$('$PY' -m pybind11 --cmakedir) -DCMAKE_CUDA_ARCHITECTURES=$CC_CAP \
    && cmake --build build/gpu -j \$(nproc)"
fi
rm -rf "$TREE" && mkdir -p "$TREE" && cp -r src/pympar "$TREE"/ && cp build/gpu/_C*.so build/gpu/_cuda*.so "$TREE"/pympar/ 2>/dev/null
"$PY" -c "from pympar import kernels; print('cuda kernels:', kernels.cuda_available(), 'cpp kernels:', kernels.native_available())" \
  >>"$RES/build.log" 2>&1

# --- 4. the gpu-marked tests ------------------------------------------------------------------
TESTS=(tests/test_kernels_gpu.py tests/test_gpu_engine.py)
[ -f tests/test_comm_nccl.py ] && TESTS+=(tests/test_comm_nccl.py)
PT_TIMEOUT=()
"$PY" -c "import pytest_timeout" >/dev/null 2>&1 && PT_TIMEOUT=(--timeout 100)
stage tests 110 "$RES/tests.log" "$PY" -m pytest -q -rfEs -p no:cacheprovider -o addopts= -m gpu \
  "${PT_TIMEOUT[@]}" --junitxml="$RES/tests.xml" "${TESTS[@]}"

# --- 5. the benchmark -------------------------------------------------------------------------
stage bench 90 "$RES/bench.log" "$PY" bench/gpu_bench.py --json "$RES/gpu_bench.json"

# --- 6. model parallelism on the GPU (last: it gets whatever time is left) ---------------------
# 2 ranks on this node's GPU(s) run the CI slice of the layout matrix (pp, tp+sp, ep, ZeRO-1 on
# CuPy, against the host single-process reference), and the trainer with --pp 2 --tp 2 on 4 ranks
L_TIMEOUT=()
"$PY" -c "import pytest_timeout" >/dev/null 2>&1 && L_TIMEOUT=(--timeout 200)
stage layouts 120 "$RES/layouts.log" "$PY" -m pytest -q -rfEs -p no:cacheprovider -o addopts= -m gpu \
  "${L_TIMEOUT[@]}" "tests/test_layouts.py::test_ci_slice_of_layouts_on_gpus_matches_single_process[2]" \
  "tests/test_layouts.py::test_cli_layout_on_gpus_matches_one_cpu_process[pp2-tp2]"

# --- 7. summary -------------------------------------------------------------------------------
{
  echo "{"
  first=1
  for k in "${!STATUS[@]}"; do
    [ $first -eq 1 ] || echo ","
    first=0
    printf '"%s": %s' "$k" "${STATUS[$k]}"
  done
  echo "}"
} >"$RES/stages.json"
"$PY" - "$RES" "$(( $(date +%s) - T0 ))" <<'EOF' || cat "$RES/stages.json"
import json, os, re, sys
res, secs = sys.argv[1], int(sys.argv[2])
def load(name):
    try:
        with open(os.path.join(res, name)) as f:
            return json.load(f)
    except Exception as e:
        return f"unreadable: {type(e).__name__}: {e}"
def tail(name, n=40):
    try:
        with open(os.path.join(res, name)) as f:
            return f.read().splitlines()[-n:]
    except Exception:
        return []
summary = {"seconds": secs, "stages": load("stages.json"), "env": load("env.json"), "bench": load("gpu_bench.json")}
def counted(log):
    counts = {}
    for line in tail(log, 200):
        for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed)", line):
            counts[what] = int(n)
    return {"counts": counts, "failures": [l for l in tail(log, 400) if l.startswith(("FAILED", "ERROR"))]}
summary["tests"] = counted("tests.log")
summary["layout_tests"] = counted("layouts.log")
summary["build_tail"] = tail("build.log", 12)
with open(os.path.join(res, "gpu_check.json"), "w") as f:
    json.dump(summary, f, indent=1, default=str)
print(json.dumps({"seconds": secs, "stages": summary["stages"], "tests": summary["tests"]["counts"],
                  "layout_tests": summary["layout_tests"]["counts"]}, default=str))
EOF
for f in gpu_check.json run.log env.json build.log tests.log bench.log layouts.log nvidia-smi.txt; do
  [ -f "$RES/$f" ] && cp "$RES/$f" "$DEST/"
done
echo "gpu_check: results in $DEST ($(( $(date +%s) - T0 )) s)"
exit 0
