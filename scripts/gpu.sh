#!/usr/bin/env bash
# One-call GPU workflow for the device machine (no network; CUTLASS headers come from the
# nvidia-cutlass wheel carried in .whl/). Builds the selected kernels with ninja into build/gpu
# (incremental while the build folder survives), then runs what is asked, logging under $OUT.
#
#   scripts/gpu.sh build            # configure + ninja; FLASHHOPPER_ARCHS/MODES/DTYPES/HDIMS/MASKS/VARIANTS
#                                   # select the kernels (e.g. FLASHHOPPER_VARIANTS=no-pingpong)
#   scripts/gpu.sh test [pytest args]
#   scripts/gpu.sh bench [bench args]  # bench/bench_attention.py (--fa3-path .peers/fa3 adds FlashAttention-3)
#   scripts/gpu.sh sass             # instruction counts per kernel (HGMMA, UTMALDG, SYNCS, ...)
#   scripts/gpu.sh sanitize         # compute-sanitizer memcheck, racecheck, synccheck, initcheck over the forward
#                                   # (16-bit and fp8), backward and fp8 quantization checks on small shapes;
#                                   # non-zero exit if any reports an error (SANITIZE_TOOLS, SANITIZE_CHECKS pick;
#                                   # SANITIZE_ARGS, e.g. "--arch 80", go to the attention checks)
#   scripts/gpu.sh sanitize-all     # the four tools over every kernel of the build (both families, every dtype,
#                                   # mask and variant, deterministic backward, quantization); SANITIZE_JOBS at once
#   scripts/gpu.sh fuzz [args]      # scripts/fuzz.py: 2000 random configurations over every entry point, JSON summary
#   scripts/gpu.sh check            # scripts/check_fwd.py: every built forward kernel on a few odd shapes
#   scripts/gpu.sh check-bwd        # scripts/check_bwd.py: the same for the backward kernels
#   scripts/gpu.sh health           # GEMM ceiling + clocks under load; non-zero exit if throttled
#   scripts/gpu.sh ablate           # named variants (cpp/sm90/variants.h) timed next to production, one process:
#                                   # ABLATE_VARIANTS (default no-pingpong), ABLATE_MODE fwd|bwd|both, ABLATE_DTYPE (bf16|fp16),
#                                   # ABLATE_HDIMS, ABLATE_SEQLENS, ABLATE_CAUSAL, ABLATE_ROUNDS
#   scripts/gpu.sh build-base       # the baseline tree (BASE_SRC, default build/base-src), by its own scripts
#   scripts/gpu.sh compare [bench args]  # baseline vs this tree: bench_attention.py in alternating processes
#                                   # (COMPARE_RUNS pairs, default 2), then bench/compare_builds.py (2% check)
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
    -DFLASHHOPPER_ARCHS="${FLASHHOPPER_ARCHS-auto}" \
    -DFLASHHOPPER_MODES="${FLASHHOPPER_MODES:-fwd;bwd}" \
    -DFLASHHOPPER_DTYPES="${FLASHHOPPER_DTYPES:-bf16;fp16;e4m3}" \
    -DFLASHHOPPER_HDIMS="${FLASHHOPPER_HDIMS:-auto}" \
    -DFLASHHOPPER_MASKS="${FLASHHOPPER_MASKS:-none;causal}" \
    -DFLASHHOPPER_VARIANTS="${FLASHHOPPER_VARIANTS:-}" \
    -DFLASHHOPPER_SCORE_MODS="${FLASHHOPPER_SCORE_MODS:-none}" \
    -DFLASHHOPPER_DROPOUT="${FLASHHOPPER_DROPOUT:-off}" \
    -DFLASHHOPPER_VARLEN="${FLASHHOPPER_VARLEN:-off;on}" \
    -DFLASHHOPPER_CUDA_FLAGS="${FLASHHOPPER_CUDA_FLAGS:-}" \
    -DFLASHHOPPER_PTXAS_VERBOSE=ON >"$OUT/configure.log" 2>&1 || { cat "$OUT/configure.log"; exit 1; }
  local t1=$SECONDS
  ninja -C "$BUILD_DIR" -j "$(nproc)" >"$OUT/build.log" 2>&1 || { grep -B2 -A20 "error" "$OUT/build.log" | head -120; exit 1; }
  local t2=$SECONDS
  cp -f "$BUILD_DIR"/_C*.so "$PKG_DIR/"
  echo "build: configure $((t1 - t0)) s, compile $((t2 - t1)) s on $(nproc) cores ($(grep -c 'Building CUDA' "$OUT/build.log" || true) CUDA objects rebuilt)" | tee "$OUT/build-time.txt"
  # Registers / spills of every kernel, from ptxas, under readable names.
  "$PY" scripts/sass_summary.py --ptxas "$OUT/build.log" >"$OUT/ptxas.txt" || true
}

do_test() {
  "$PY" -m pytest -q -m gpu tests "$@" 2>&1 | tee "$OUT/test.log"
}

# Named variants timed next to the production kernels in one process: one extension built with
# FLASHHOPPER_VARIANTS into a package folder of its own (the main build stays as it is), then
# bench_attention.py with "flashhopper" and "flashhopper@<variant>" for each variant, rounds interleaved.
do_ablate() {
  local variants=${ABLATE_VARIANTS:-no-pingpong} dtype=${ABLATE_DTYPE:-bf16} pkg="$ROOT/build/ablate/python" v
  local providers="flashhopper"
  for v in $variants; do providers+=" flashhopper@$v"; done
  rm -rf "$pkg" && mkdir -p "$pkg"
  cp -r "$ROOT/python/flashhopper" "$pkg/"
  rm -f "$pkg"/flashhopper/_C*.so
  # Build logs stay in the build tree: what comes back from $OUT is limited to a few files.
  (OUT="$ROOT/build/ablate-logs" && mkdir -p "$OUT" && BUILD_DIR="$ROOT/build/ablate-build" PKG_DIR="$pkg/flashhopper" \
    FLASHHOPPER_DTYPES="$dtype" FLASHHOPPER_HDIMS="${ABLATE_HDIMS:-128}" FLASHHOPPER_VARIANTS="${variants// /;}" \
    do_build >/dev/null) || { echo "ablate build failed: see build/ablate-logs"; return 1; }
  PYTHONPATH="$pkg" "$PY" bench/bench_attention.py --providers $providers --mode "${ABLATE_MODE:-fwd}" --dtype "$dtype" \
    --hdims ${ABLATE_HDIMS:-128} --seqlens ${ABLATE_SEQLENS:-512 2048 16384} --causal "${ABLATE_CAUSAL:-both}" \
    --warmup-ms 10 --rep-ms 40 --rounds "${ABLATE_ROUNDS:-3}" --out "$OUT/ablate.json" 2>&1 | tee "$OUT/ablate.log"
}

# Before/after on one machine: the baseline tree (BASE_SRC, e.g. `git archive <commit> | tar -x -C
# build/base-src`, carried) built by its own scripts/gpu.sh into build/base-python (a copy of its package:
# carrying BASE_SRC again does not drop the build), then the baseline's and this tree's bench_attention.py
# in alternating processes, each on its own package, with the same arguments (ones both harnesses know:
# --hdims --seqlens --causal --mode --dtype --providers --rounds --warmup-ms --rep-ms). Build both with the
# same FLASHHOPPER_* selection.
BASE_PY=$ROOT/build/base-python

base_src() {
  local base=${BASE_SRC:-$ROOT/build/base-src}
  [ -f "$base/scripts/gpu.sh" ] || { echo "no baseline tree at $base (BASE_SRC)" >&2; exit 1; }
  echo "$base"
}

do_build_base() {
  local base
  base=$(base_src)
  [ -e "$base/.whl" ] || ln -s "$ROOT/.whl" "$base/.whl"  # the CUTLASS wheel its build unpacks
  rm -rf "$BASE_PY" && mkdir -p "$BASE_PY" && cp -r "$base/python/flashhopper" "$BASE_PY/"
  OUT="$ROOT/build/base-logs" BUILD_DIR="$ROOT/build/base-build" PKG_DIR="$BASE_PY/flashhopper" "$base/scripts/gpu.sh" build
}

do_compare() {
  local base i runs=${COMPARE_RUNS:-2}
  base=$(base_src)
  ls "$BASE_PY"/flashhopper/_C*.so >/dev/null 2>&1 || { echo "baseline not built: scripts/gpu.sh build-base" >&2; return 1; }
  ls "$PKG_DIR"/_C*.so >/dev/null 2>&1 || { echo "not built: scripts/gpu.sh build" >&2; return 1; }
  do_health || [ "${FORCE_BENCH:-0}" = 1 ] || { echo "compare skipped: GPU throttled"; return 1; }
  rm -f "$OUT"/compare-*.json
  for ((i = 1; i <= runs; i++)); do
    (cd "$base" && PYTHONPATH="$BASE_PY" "$PY" bench/bench_attention.py "$@" --out "$OUT/compare-base-$i.json") \
      >"$OUT/compare-base-$i.log" 2>&1 || { tail -5 "$OUT/compare-base-$i.log"; return 1; }
    "$PY" bench/bench_attention.py "$@" --label new --out "$OUT/compare-new-$i.json" \
      >"$OUT/compare-new-$i.log" 2>&1 || { tail -5 "$OUT/compare-new-$i.log"; return 1; }
  done
  "$PY" bench/compare_builds.py --base "$OUT"/compare-base-*.json --new "$OUT"/compare-new-*.json | tee "$OUT/compare.md"
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

# compute-sanitizer's tools over checks given as "name|script args" (scripts/<script> with <args>), every run
# logged under $OUT as sanitize-<name>-<tool>.log. SANITIZE_JOBS runs go at once (default 4: the tools are
# mostly host-bound and the small shapes leave the GPU room), each under SANITIZE_TIMEOUT seconds (default
# 900). The exit status is non-zero if any tool reports an error or any check fails.
run_sanitizer() {
  local jobs=${SANITIZE_JOBS:-4} failed=0 spec name script tool log rc t0=$SECONDS
  local -a logs=()
  for spec in "$@"; do
    name=${spec%%|*}; script=${spec#*|}
    for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck}; do
      while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
      log="$OUT/sanitize-$name-$tool.log"
      logs+=("$log")
      # The status goes to a file: `wait -n` above may already have reaped the job.
      (rc=0; timeout "${SANITIZE_TIMEOUT:-900}" compute-sanitizer --tool "$tool" --error-exitcode 1 \
         "$PY" scripts/$script >"$log" 2>&1 || rc=$?; echo "$rc" >"$log.rc") &
    done
  done
  wait
  for log in "${logs[@]}"; do
    rc=$(cat "$log.rc" 2>/dev/null || echo "?")
    name=${log##*/sanitize-}; name=${name%.log}
    if [ "$rc" = 0 ]; then echo "$name: ok"; else echo "$name: FAILED (exit $rc; $log)"; failed=1; fi
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|kernels checked|MISMATCH|FAILED" "$log" | tail -2 || true
    rm -f "$log.rc"
  done
  echo "sanitizer runs: ${#logs[@]} in $((SECONDS - t0)) s; $([ $failed = 0 ] && echo clean || echo FAILURES)"
  return "$failed"
}

# The quick set: bf16 and the fp8 forward, the bf16 backward, the quantization (SANITIZE_CHECKS picks by name;
# SANITIZE_ARGS, e.g. "--arch 80", go to the attention checks).
do_sanitize() {
  local -A checks=([check_fwd]="check_fwd|check_fwd.py --small --dtypes bfloat16 float8_e4m3fn ${SANITIZE_ARGS:-}"
                   [check_bwd]="check_bwd|check_bwd.py --small --dtypes bfloat16 ${SANITIZE_ARGS:-}"
                   [check_quant]="check_quant|check_quant.py --small --dtypes bfloat16")
  local -a specs=() c
  for c in ${SANITIZE_CHECKS:-check_fwd check_bwd check_quant}; do specs+=("${checks[$c]}"); done
  run_sanitizer "${specs[@]}"
}

# Every padded-batch kernel of the build: each family's forward (all dtypes, masks, variants; the softcap and
# dropout kernels and sinks where the build has them), backward (normal and deterministic), and the fp8
# quantization; the packed-batch (varlen) 16-bit kernels, forward and backward (check_varlen.py); the KV-cache
# kernels with their appends, 16-bit and e4m3 caches (check_kvcache.py); on small shapes, under all four tools.
do_sanitize_all() {
  local a f archs modes extras varlen kvcache
  # The families of the build that this GPU runs (an A100 with a both-families build: the sm80 ones).
  archs=$("$PY" -c "import torch, flashhopper as f; from flashhopper.dispatch import runs_on
cap = torch.cuda.get_device_capability()
print(*[a for a in f.build_info().get('archs', []) if runs_on(f'sm{a}', cap)])")
  modes=$("$PY" -c "import flashhopper as f; print(*f.build_info().get('modes', []))")
  [ -n "$archs" ] || { echo "sanitize-all: no kernels of this build run on this GPU (${PKG_DIR})" >&2; return 1; }
  # The check scripts' flags for the built variants: softcap and dropout pick those kernels, sinks is a runtime option.
  extras=$("$PY" -c "import flashhopper as f; i = f.build_info()
print(*(['--softcap=30'] if 'softcap' in i.get('score_mods', []) else []),
      *(['--dropout=0.1'] if 'on' in i.get('dropout', []) else []), '--sinks')")
  varlen=$("$PY" -c "import flashhopper as f; print(*f.build_info().get('varlen', []))")
  local -a specs=()
  for a in $archs; do
    [[ " $varlen " == *" on "* ]] && specs+=("varlen-sm$a|check_varlen.py --small --arch $a")
    for f in "" $extras; do
      # (sinks: 16-bit kernels only; check_fwd would run its fp8 ones again without them)
      [[ " $modes " == *" fwd "* ]] && specs+=("fwd-sm$a$f|check_fwd.py --small --arch $a $f$([ "$f" = --sinks ] &&
                                                 echo " --dtypes bfloat16 float16")")
      [[ " $modes " == *" bwd "* ]] && specs+=("bwd-sm$a$f|check_bwd.py --small --arch $a $f"
                                               "bwd-sm$a$f-det|check_bwd.py --small --arch $a --deterministic $f")
    done
  done
  [[ " $archs " == *" 90 "* ]] && specs+=("quant|check_quant.py --small")
  kvcache=$("$PY" -c "import flashhopper as f; print(*f.build_info().get('kvcache', []))")
  [[ " $archs " == *" 90 "* && " $kvcache " =~ " "(on|e4m3)" " ]] && specs+=("kvcache|check_kvcache.py")
  run_sanitizer "${specs[@]}"
}

cmd=${1:-all}
shift || true
case "$cmd" in
  build) do_build ;;
  test) do_test "$@" ;;
  bench) do_bench "$@" ;;
  sass) do_sass ;;
  sanitize) do_sanitize ;;
  sanitize-all) do_sanitize_all ;;
  fuzz) "$PY" scripts/fuzz.py --json "$OUT/fuzz.json" "$@" 2>&1 | tee "$OUT/fuzz.log" ;;
  health) do_health ;;
  ablate) do_ablate ;;
  build-base) do_build_base ;;
  compare) do_compare "$@" ;;
  profile) do_profile "$@" ;;
  check) "$PY" scripts/check_fwd.py "$@" 2>&1 | tee "$OUT/check.log" ;;
  check-bwd) "$PY" scripts/check_bwd.py "$@" 2>&1 | tee "$OUT/check-bwd.log" ;;
  all) do_build; do_test; do_sass; do_bench "$@" ;;
  *) echo "usage: $0 build|test|bench|sass|sanitize|sanitize-all|fuzz|check|check-bwd|health|ablate|build-base|compare|profile|all" >&2
     exit 2 ;;
esac
