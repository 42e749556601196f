#!/bin/bash
# Session 19, call 1: phase 2's GPU tests with the aligned lag windows (never run on the GPU with them), phase 2's forward and backward kernels timed with both window placements, and the per-sublayer main table (last run in session 17).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv > $OUT/nvidia_smi.txt 2>&1
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 230 python3 -m pytest -v -p no:cacheprovider -m gpu -o addopts="" tests/kernels/test_mosaic_gpu_phase2.py > $OUT/gpu_tests_phase2.txt 2>&1; echo "gpu tests rc=$? $(( $(date +%s)-S ))s"; grep -E "PASS|FAIL|passed|failed|Error" $OUT/gpu_tests_phase2.txt | tail -8
S=$(date +%s)
timeout 70 python3 experiments/mgpu/time_phase2.py --base-only --msar-only > $OUT/time_phase2.txt 2>&1; echo "time_phase2 rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|ms " $OUT/time_phase2.txt | cut -c1-200
S=$(date +%s)
timeout 80 python3 experiments/mgpu/time_phase2.py --backward --base-only > $OUT/time_phase2_bwd.txt 2>&1; echo "time_phase2 bwd rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|ms " $OUT/time_phase2_bwd.txt | cut -c1-200
S=$(date +%s)
OUT=$OUT timeout 170 python3 -m pallas_kernels.depth_attention.bench --backward pallas > $OUT/bench.txt 2>&1; echo "bench rc=$? $(( $(date +%s)-S ))s"; grep -v "^{" $OUT/bench.txt | tail -12
