#!/usr/bin/env bash
# Development build in place: configure and build into build/dev with the dev venv's Python,
# then copy pympar/_C*.so (and pympar/_cuda*.so when nvcc is present) next to the sources, so
# `PYTHONPATH=/work/main python ...` uses them. Pass extra CMake flags as arguments, e.g.
#   bash tools/build_native.sh -DPYMPAR_CUDA=OFF        # skip the CUDA module (faster; CMake caches
#                                                      # it: -DPYMPAR_CUDA=ON turns it back on)
#   bash tools/build_native.sh -DCMAKE_CUDA_ARCHITECTURES=90
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-/work/venv/bin/python}
[ -x "$PY" ] || PY=$(command -v python3)
BUILD=build/dev
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DPython_EXECUTABLE="$PY" -Dpybind11_DIR="$("$PY" -m pybind11 --cmakedir)" "$@"
cmake --build "$BUILD" -j "$(nproc)"
rm -f pympar/_C*.so pympar/_cuda*.so
built=("$BUILD"/_C*.so)
grep -q "^PYMPAR_CUDA:BOOL=OFF" "$BUILD/CMakeCache.txt" || built+=("$BUILD"/_cuda*.so)
for so in "${built[@]}"; do
  [ -e "$so" ] || continue
  # copy then rename: overwriting the file in place crashes processes that have it loaded
  cp -f "$so" "pympar/.$(basename "$so").tmp" && mv -f "pympar/.$(basename "$so").tmp" "pympar/$(basename "$so")"
  echo "installed $(basename "$so") -> pympar/"
done
