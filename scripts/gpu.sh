#!/usr/bin/env bash
# One-call GPU workflow for the device machine (no network; CUTLASS headers come from the
# nvidia-cutlass wheel carried in .whl/). Builds the selected kernels with ninja into build/gpu
# (incremental while the build folder survives), then runs what is asked, logging under $OUT.
#
#   scripts/gpu.sh build            # configure + ninja (FLASHHOPPER_ARCHS/MODES/DTYPES/HDIMS select kernels)
#   scripts/gpu.sh test [pytest args]
#   scripts/gpu.sh bench [bench args]
#   scripts/gpu.sh sass             # instruction counts per kernel (HGMMA, UTMALDG, SYNCS, ...)
#   scripts/gpu.sh sanitize         # compute-sanitizer memcheck + racecheck on small shapes
#                                   # (SANITIZE_SCRIPTS=check_quant: the fp8 quantization kernel)
#   scripts/gpu.sh check            # scripts/check_fwd.py: every built kernel on a few odd shapes
#   scripts/gpu.sh check-bwd        # scripts/check_bwd.py: the same for the backward kernels
#   scripts/gpu.sh health           # GEMM ceiling + clocks under load; non-zero exit if throttled
#   scripts/gpu.sh ablate           # variants built side by side and timed: d128 bf16 with ping-pong /
#                                   # overlap off, 128x176, 3 K/V stages; backward ones with ABLATE_MODE=bwd
#                                   # (ABLATE_VARIANTS="full n176" picks some; ABLATE_HDIMS, ABLATE_SEQLENS, ABLATE_ROUNDS too;
#                                   #  fp8 tiles: ABLATE_DTYPES=e4m3 ABLATE_PROVIDERS=flashhopper-fp8 ABLATE_VARIANTS="full fp8-n224";
#                                   #  sm80: FLASHHOPPER_ARCHS=80 ABLATE_PROVIDERS=flashhopper-sm80 ABLATE_VARIANTS="full sm80-d64-n64")
#   scripts/gpu.sh profile --hdim 256 --seqlen 2048 --causal   # ncu sections of one launch (--mode bwd too)
#   scripts/gpu.sh all              # build, test, sass, bench
#
# Typical device call: `run` with carry [".whl"] and command `scripts/gpu.sh all`.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/build/gpu-logs}
BUILD_DIR=${BUILD_DIR:-$ROOT/build/gpu}
PKG_DIR=${PKG_DIR:-$ROOT/python/flashhopper}  # where the built _C lands
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# The device image has CUDA under /usr/local/cuda but not always on PATH.
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi

cutlass_include() {
  # Unpack the headers once; a wheel is a zip.
  local dst="$ROOT/build/cutlass"
  if [ ! -f "$dst/cutlass_library/source/include/cutlass/cutlass.h" ]; then
    local whl
    whl=$(ls "$ROOT"/.whl/nvidia_cutlass-*.whl 2>/dev/null | head -n1 || true)
    if [ -z "$whl" ]; then
      if "$PY" -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('cutlass_library') is None)"; then
        return 0  # installed: CMake finds it
      fi
      echo "no CUTLASS headers: carry .whl/nvidia_cutlass-4.2.0.0-py3-none-any.whl" >&2
      exit 1
    fi
    mkdir -p "$dst"
    "$PY" -m zipfile -e "$whl" "$dst" >/dev/null
  fi
  echo "$dst/cutlass_library/source/include"
}

do_build() {
  local inc
  inc=$(cutlass_include)
  local t0=$SECONDS
  cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" \
    -DPython_EXECUTABLE="$(command -v "$PY")" \
    -Dpybind11_DIR="$("$PY" -m pybind11 --cmakedir)" \
    ${inc:+-DCUTLASS_INCLUDE_DIR="$inc"} \
    -DFLASHHOPPER_ARCHS="${FLASHHOPPER_ARCHS:-90}" \
    -DFLASHHOPPER_MODES="${FLASHHOPPER_MODES:-fwd;bwd}" \
    -DFLASHHOPPER_DTYPES="${FLASHHOPPER_DTYPES:-bf16;fp16;e4m3}" \
    -DFLASHHOPPER_HDIMS="${FLASHHOPPER_HDIMS:-64;128;256}" \
    -DFLASHHOPPER_CUDA_FLAGS="${FLASHHOPPER_CUDA_FLAGS:-}" \
    -DFLASHHOPPER_PTXAS_VERBOSE=ON >"$OUT/configure.log" 2>&1 || { cat "$OUT/configure.log"; exit 1; }
  local t1=$SECONDS
  ninja -C "$BUILD_DIR" -j "$(nproc)" >"$OUT/build.log" 2>&1 || { grep -B2 -A20 "error" "$OUT/build.log" | head -120; exit 1; }
  local t2=$SECONDS
  cp -f "$BUILD_DIR"/_C*.so "$PKG_DIR/"
  echo "build: configure $((t1 - t0)) s, compile $((t2 - t1)) s on $(nproc) cores ($(grep -c 'Building CUDA' "$OUT/build.log" || true) CUDA objects rebuilt)" | tee "$OUT/build-time.txt"
  # Registers / spills of every kernel, from ptxas.
  grep -E "Compiling entry|registers|spill" "$OUT/build.log" \
    | sed -E 's/_ZN11flashhopper[A-Za-z0-9_]*(Fwd|Bwd)MainloopIN7cutlass[0-9]+([a-z0-9_]+)ELi([0-9]+)E[A-Za-z0-9_]*TileSizeILi[0-9]+ELb([01])[A-Za-z0-9_]*/\1 \2 d\3 causal\4/' \
    >"$OUT/ptxas.txt" || true
}

do_test() {
  "$PY" -m pytest -q -m gpu tests "$@" 2>&1 | tee "$OUT/test.log"
}

# Build variants side by side (own build and package folders, all at once: each one is a few
# translation units) and time ours only, so that each mechanism's worth is measured in one run.
#   ABLATE_VARIANTS  names from the list below (default: the forward ones)
#   ABLATE_MODE      fwd (default) or bwd;  ABLATE_HDIMS, ABLATE_SEQLENS, ABLATE_CAUSAL (off/on/both)
do_ablate() {
  local base_pkg=$PKG_DIR mode=${ABLATE_MODE:-fwd}
  local all=("full:" "no-pingpong:-DFLASHHOPPER_NO_PINGPONG" "no-overlap:-DFLASHHOPPER_NO_OVERLAP"
             "no-both:-DFLASHHOPPER_NO_PINGPONG -DFLASHHOPPER_NO_OVERLAP" "n176:-DFLASHHOPPER_HDIM128_BLOCK_N=176"
             "kv3q1:-DFLASHHOPPER_HDIM128_STAGES=3"
             "d256-nopp:-DFLASHHOPPER_HDIM256_PINGPONG=0"
             "bwd-no-dq-reduce:-DFLASHHOPPER_BWD_NO_DQ_REDUCE" "bwd-m80:-DFLASHHOPPER_BWD_HDIM128_BLOCK_M=80" "bwd-dv-after-ds:-DFLASHHOPPER_BWD_DV_AFTER_DS"
             "bwd-serial-dq:-DFLASHHOPPER_BWD_SERIAL_DQ_CONVERT" "bwd-dq-lag2:-DFLASHHOPPER_BWD_DQ_COUNT_LAG=2"
             "bwd-dq-stage-plain:-DFLASHHOPPER_BWD_DQ_STAGE_PLAIN" "bwd-dq-tma:-DFLASHHOPPER_BWD_DQ_TMA" "bwd-d256-ds2:-DFLASHHOPPER_BWD_HDIM256_DS_STAGES=2" "bwd-dq-atomic-d128:-DFLASHHOPPER_BWD_DQ_ATOMIC_MIN_HDIM=128" "bwd-d256-n64:-DFLASHHOPPER_BWD_HDIM256_BLOCK_N=64" "bwd-d256-n64-dq4:-DFLASHHOPPER_BWD_HDIM256_BLOCK_N=64 -DFLASHHOPPER_BWD_HDIM256_DQ_SLICES=4"
             "bwd-m80-dv-after-ds:-DFLASHHOPPER_BWD_HDIM128_BLOCK_M=80 -DFLASHHOPPER_BWD_DV_AFTER_DS"
             "bwd-dq-tensor-tma:-DFLASHHOPPER_BWD_DQ_TENSOR_TMA"
             "bwd-d128-s:-DFLASHHOPPER_BWD_HDIM128_S_LAYOUT=1" "bwd-d128-s-ds2:-DFLASHHOPPER_BWD_HDIM128_S_LAYOUT=2"
             "bwd-lpt4:-DFLASHHOPPER_BWD_CAUSAL_SECTION_WAVES=4" "bwd-lpt64:-DFLASHHOPPER_BWD_CAUSAL_SECTION_WAVES=64"
             "fp8-n96:-DFLASHHOPPER_FP8_HDIM128_BLOCK_N=96 -DFLASHHOPPER_FP8_HDIM256_BLOCK_N=96"
             "fp8-n160:-DFLASHHOPPER_FP8_HDIM128_BLOCK_N=160" "fp8-n192:-DFLASHHOPPER_FP8_HDIM128_BLOCK_N=192"
             "fp8-n224:-DFLASHHOPPER_FP8_HDIM128_BLOCK_N=224" "fp8-n256:-DFLASHHOPPER_FP8_HDIM128_BLOCK_N=256"
             "fp8-d64-m128:-DFLASHHOPPER_FP8_HDIM64_BLOCK_M=128" "fp8-d64-m128n192:-DFLASHHOPPER_FP8_HDIM64_BLOCK_M=128 -DFLASHHOPPER_FP8_HDIM64_BLOCK_N=192"
             "fp8-d64-n160:-DFLASHHOPPER_FP8_HDIM64_BLOCK_N=160" "fp8-d64-n192:-DFLASHHOPPER_FP8_HDIM64_BLOCK_N=192"
             "fp8-vt-in-kernel:-DFLASHHOPPER_FP8_V_TRANSPOSE_IN_KERNEL"
             "sm80-d64-n64:-DFLASHHOPPER_SM80_HDIM64_BLOCK_N=64" "sm80-d64-n128:-DFLASHHOPPER_SM80_HDIM64_BLOCK_N=128"
             "sm80-d64-m64:-DFLASHHOPPER_SM80_HDIM64_BLOCK_M=64" "sm80-fwd-d256-small:-DFLASHHOPPER_SM80_HDIM256_FWD_SMALL")
  local want=" ${ABLATE_VARIANTS:-full no-pingpong no-overlap no-both n176 kv3q1} " chosen=() pids=()
  for v in "${all[@]}"; do
    [[ $want == *" ${v%%:*} "* ]] && chosen+=("$v")
  done
  cutlass_include >/dev/null  # unpack the headers once, before the concurrent builds
  for v in "${chosen[@]}"; do  # build all variants concurrently
    local name=${v%%:*} flags=${v#*:}
    local pkg="$ROOT/build/ablate/$name/flashhopper"
    mkdir -p "$pkg"
    cp -r "$base_pkg"/*.py "$base_pkg"/report "$pkg/"
    # Build logs stay in the build tree: what comes back from $OUT is limited to a few files.
    (OUT="$ROOT/build/ablate-logs-$name" && mkdir -p "$OUT" && BUILD_DIR="$ROOT/build/ablate-$name" PKG_DIR="$pkg" FLASHHOPPER_CUDA_FLAGS="$flags" \
      FLASHHOPPER_DTYPES="${ABLATE_DTYPES:-bf16}" FLASHHOPPER_HDIMS="${ABLATE_HDIMS:-128}" do_build >/dev/null \
      || echo "ablate build $name failed: see build/ablate-logs-$name") &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
  for v in "${chosen[@]}"; do
    local name=${v%%:*} flags=${v#*:}
    echo "== $name ($flags)" | tee -a "$OUT/ablate.log"
    PYTHONPATH="$ROOT/build/ablate/$name" "$PY" bench/bench_attention.py --providers ${ABLATE_PROVIDERS:-flashhopper} --mode "$mode" \
      --hdims ${ABLATE_HDIMS:-128} --seqlens ${ABLATE_SEQLENS:-512 2048 16384} --causal "${ABLATE_CAUSAL:-both}" \
      --warmup-ms 10 --rep-ms 40 --rounds ${ABLATE_ROUNDS:-1} --out "$OUT/ablate-$name.json" 2>&1 | grep -E "^\*\*|^\| [0-9]" | tee -a "$OUT/ablate.log"
  done
}

# ncu on the third launch of one configuration (args go to scripts/profile_attention.py; with
# --mode bwd the backward's main kernel is profiled).
do_profile() {
  # PROFILE_KERNEL: a regex for other kernels (SDPA's FlashAttention-2: flash_fwd_kernel, flash_bwd_dq_dk_dv)
  # NCU_ARGS: more ncu options, e.g. "--print-details all --section SourceCounters" (stall reasons, hot spots)
  local tag kernel=fwd_kernel
  [[ " $* " == *" --mode bwd "* ]] && kernel=bwd_kernel
  kernel=${PROFILE_KERNEL:-$kernel}
  tag=$(echo "$*" | tr -c 'A-Za-z0-9' '_')
  ncu --clock-control none --kernel-name "regex:${kernel}" --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section ComputeWorkloadAnalysis \
    --section InstructionStats --section LaunchStats --section SchedulerStats --section MemoryWorkloadAnalysis_Tables \
    ${NCU_ARGS:-} "$PY" scripts/profile_attention.py "$@" >"$OUT/ncu_${tag}.txt" 2>&1 || true
  grep -E "Duration|Throughput|Pipe|Hit Rate|Stall|Warp Cycles|Issued|Bandwidth|Busy|L2 Cache|Bank" "$OUT/ncu_${tag}.txt" | head -60
}

do_health() {
  "$PY" scripts/gpu_health.py 2>&1 | tee "$OUT/health.txt"
}

do_bench() {
  # Refuse to record numbers from a throttled GPU (FORCE_BENCH=1 overrides).
  do_health || [ "${FORCE_BENCH:-0}" = 1 ] || { echo "bench skipped: GPU throttled"; return 1; }
  "$PY" bench/bench_attention.py "$@" 2>&1 | tee "$OUT/bench.log"
}

do_sass() {
  local so
  so=$(ls "$PKG_DIR"/_C*.so | head -n1)
  cuobjdump --dump-sass "$so" >"$OUT/sass.txt" 2>/dev/null
  "$PY" scripts/sass_summary.py "$OUT/sass.txt" | tee "$OUT/sass-summary.txt"
}

# SANITIZE_SCRIPTS picks the checks (default both passes); each runs its --small shapes, bf16;
# SANITIZE_ARGS adds arguments (e.g. "--arch 80").
do_sanitize() {
  for script in ${SANITIZE_SCRIPTS:-check_fwd check_bwd}; do
    for tool in memcheck racecheck; do
      local log="$OUT/sanitize-$script-$tool.log"
      compute-sanitizer --tool "$tool" --error-exitcode 1 "$PY" "scripts/$script.py" --small --dtypes bfloat16 ${SANITIZE_ARGS:-} \
        >"$log" 2>&1; echo "$script $tool exit $?" | tee -a "$log"
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|worst" "$log"
    done
  done
}

cmd=${1:-all}
shift || true
case "$cmd" in
  build) do_build ;;
  test) do_test "$@" ;;
  bench) do_bench "$@" ;;
  sass) do_sass ;;
  sanitize) do_sanitize ;;
  health) do_health ;;
  ablate) do_ablate ;;
  profile) do_profile "$@" ;;
  check) "$PY" scripts/check_fwd.py "$@" 2>&1 | tee "$OUT/check.log" ;;
  check-bwd) "$PY" scripts/check_bwd.py "$@" 2>&1 | tee "$OUT/check-bwd.log" ;;
  all) do_build; do_test; do_sass; do_bench "$@" ;;
  *) echo "usage: $0 build|test|bench|sass|sanitize|check|check-bwd|health|ablate|profile|all" >&2; exit 2 ;;
esac
