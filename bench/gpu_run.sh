#!/usr/bin/env bash
# One prepared device run (../shared/reference/gpu-machine.md): install the carried wheels, run the cuda
# tests, then bench/gpu_bench.py. Carried (git-ignored; `bash bench/gpu_prepare.sh` makes them): .whl/ (Python 3.12 wheels of what the GPU
# machine lacks) and .gpu/smollm2/ (SmolLM2's config.json and tokenizer files). Output under $OUT.
#   [BENCH_TIMEOUT=480] bash bench/gpu_run.sh [tests|bench|all|linears|attention|kernels] [gpu_bench.py (gpu_linears.py, gpu_attention.py) arguments...]
#   kernels: the cuda tests, then the attention's thresholds and fp8_gemv's tiles swept (one call, ~6 min)
#   e.g. the quantized formats (issue 25): bash bench/gpu_run.sh bench --shapes 8b --levels 1,16 --hf-batches "" --step-rows "" --quantizations int4,fp8
#   e.g. fp8_gemv's tiles (issue 25): bash bench/gpu_run.sh linears --sweep --rows 1,16
#   e.g. the decode attention in pieces or whole, by context: bash bench/gpu_run.sh attention
#   e.g. steps launched ahead against each step read back (issue 23): bash bench/gpu_run.sh bench --shapes 8b --levels 1,16 --sync-levels 1,16 --hf-batches 1,16 --step-rows 1,16,64
set -uo pipefail
what=${1:-all}; shift || true
OUT=${OUT:-/tmp/sb-gpu-out}; mkdir -p "$OUT"
if [ ! -f /tmp/site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.done || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
if [ "$what" = tests ] || [ "$what" = all ] || [ "$what" = kernels ]; then
  SWITCHBOARD_GPU_TOKENIZER=$PWD/.gpu/smollm2 timeout 240 python3 -m pytest -q -p no:cacheprovider -x \
    tests/unit/test_cuda_engine.py -o addopts="" 2>&1 | tee "$OUT/cuda_tests.txt" | tail -40
fi
if [ "$what" = linears ]; then  # the 8B shape's products alone, per weight format (bench/gpu_linears.py)
  timeout 240 python3 bench/gpu_linears.py --out "$OUT/gpu_linears.json" "$@" 2>&1 | tee "$OUT/gpu_linears.txt" | tail -40
fi
if [ "$what" = attention ]; then  # the decode attention alone, in pieces or whole, by context (bench/gpu_attention.py)
  timeout 240 python3 bench/gpu_attention.py --out "$OUT/gpu_attention.json" "$@" 2>&1 | tee "$OUT/gpu_attention.txt" | tail -30
fi
if [ "$what" = kernels ]; then
  timeout 150 python3 bench/gpu_attention.py --rows 1,16 --contexts 64,128,256,1024,4096 --split-from 32,64,128,256 \
    --out "$OUT/gpu_attention.json" 2>&1 | tee "$OUT/gpu_attention.txt" | tail -14
  timeout 200 python3 bench/gpu_linears.py --sweep --rows 1,16 --out "$OUT/gpu_linears.json" 2>&1 \
    | tee "$OUT/gpu_linears.txt" | tail -40
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout "${BENCH_TIMEOUT:-480}" python3 bench/gpu_bench.py --tokenizer .gpu/smollm2 --out "$OUT/gpu_bench.json" "$@" 2>&1 \
    | tee "$OUT/gpu_bench.txt" | grep -v "^\[.*\] starting" | tail -80
  cp /tmp/sb-gpu-bench/switchboard-*.log "$OUT/" 2>/dev/null || true
fi
