#!/bin/bash
# session 10 call 10: the committed tree (45626a4): full sm90 build, all GPU tests, checks, sanitizer, d256 bench
{
set -x
mkdir -p build/logs
OUT=build/logs FLASHHOPPER_ARCHS=90 FLASHHOPPER_DTYPES="bf16;fp16;e4m3" scripts/gpu.sh build
cat build/logs/build-time.txt
awk '/Compiling entry/{name=$0} /spill stores/ && $5!="0" {print substr(name,1,160); print}' build/logs/ptxas.txt | head
export PYTHONPATH=python
timeout 150 python3 scripts/check_bwd.py | tail -1
timeout 150 python3 scripts/check_bwd.py --deterministic | grep -cE "same_bits False|nan True"
timeout 300 python3 -m pytest -q -m gpu tests 2>&1 | tail -2
SANITIZE_SCRIPTS=check_bwd OUT=build/logs timeout 150 scripts/gpu.sh sanitize
python3 bench/bench_attention.py --mode bwd --hdims 256 --seqlens 2048 16384 --providers flashhopper sdpa-cudnn --warmup-ms 10 --rep-ms 40 --rounds 2 --out build/d256.json | grep -E '^\*\*|^\| [0-9]'
} > $OUT/log.txt 2>&1
