#!/usr/bin/env bash
# Link flashhopper._C for this machine's Python from kernel objects compiled elsewhere with the same nvcc:
#   CUTLASS_INCLUDE=... scripts/link_prebuilt.sh SRC_ROOT OBJ_DIR GEN_ARGS...
# SRC_ROOT: the source tree (its cpp/ and python/flashhopper/); OBJ_DIR: the *.o of its kernel translation
# units, cpp/quantize_fp8.cu and cpp/kvcache_append.cu (e.g. from build/<dir>/CMakeFiles/_C.dir); GEN_ARGS: the generator's
# arguments the objects were built with (cpp/generate_kernels.py --archs ... --masks ...). The kernel
# objects do not depend on Python, so a 2-core machine can compile them (an hour for a full build) and
# the GPU machine only compiles bindings.cpp and registry.cpp for its own Python (seconds): device time
# saved (docs/perf-notes.md, issue #19's workflow note).
set -euo pipefail
SRC=$(cd "$1" && pwd); OBJ=$(cd "$2" && pwd); shift 2
CUDA=${CUDA_HOME:-/usr/local/cuda}
PY=${PYTHON:-python3}
CUT=${CUTLASS_INCLUDE:?}
GEN=$(mktemp -d)
"$PY" "$SRC/cpp/generate_kernels.py" --out "$GEN" "$@" >/dev/null
FLAGS="-std=c++17 -O2 -fPIC -I$SRC/cpp -I$CUT -I$CUDA/include $($PY -m pybind11 --includes) -DFLASHHOPPER_HAS_QUANTIZE -DFLASHHOPPER_HAS_KVCACHE_APPEND -DFLASHHOPPER_CUTLASS_VERSION=\"4.2.0\" -DFLASHHOPPER_ARCHS_FROM=\"link_prebuilt.sh\""
g++ $FLAGS -c "$SRC/cpp/bindings.cpp" -o "$GEN/bindings.o" &
g++ $FLAGS -c "$GEN/registry.cpp" -o "$GEN/registry.o" &
wait
# Every object the registry names must be there: link fails on a missing launcher otherwise.
OUT="$SRC/python/flashhopper/_C$($PY -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
g++ -shared -o "$OUT" "$GEN/bindings.o" "$GEN/registry.o" "$OBJ"/*.o -L"$CUDA/lib64" -lcudart_static -ldl -lrt -lpthread
echo "linked $OUT ($(ls "$OBJ"/*.o | wc -l) objects)"
