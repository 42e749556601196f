#!/bin/bash
# Session 18, call 1: the GPU-marked tests of the Mosaic GPU phase-1 and phase-2 kernels (both changed since their last GPU run).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv > $OUT/nvidia_smi.txt 2>&1
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 420 python3 -m pytest -v -p no:cacheprovider -m gpu -o addopts="" tests/kernels/test_mosaic_gpu_phase1.py tests/kernels/test_mosaic_gpu_phase2.py > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc=$? $(( $(date +%s)-S ))s"; grep -E "PASS|FAIL|passed|failed|Error" $OUT/gpu_tests.txt | tail -20
