#!/bin/bash
# Session 19, call 3: conv lags loaded straight from global memory (any row offset, through L1) against TMA-filled aligned windows (experiments/mgpu/expand_sources.py); phase 2's GPU tests with the state's chunk as one 3D box (the new default).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv > $OUT/nvidia_smi.txt 2>&1
S=$(date +%s)
timeout 100 python3 experiments/mgpu/expand_sources.py > $OUT/expand_sources.txt 2>&1; echo "expand_sources rc=$? $(( $(date +%s)-S ))s"; cut -c1-300 $OUT/expand_sources.txt | tail -8
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 230 python3 -m pytest -v -p no:cacheprovider -m gpu -o addopts="" tests/kernels/test_mosaic_gpu_phase2.py > $OUT/gpu_tests_phase2.txt 2>&1; echo "gpu tests rc=$? $(( $(date +%s)-S ))s"; grep -E "PASS|FAIL|passed|failed|Error" $OUT/gpu_tests_phase2.txt | tail -8
