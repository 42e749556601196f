#!/bin/bash
# Session 21 (2026-12-03), call 11: phase 2's GPU tests with the two-warpgroup input kernel (the new default); the per-sublayer main table.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 120 python3 -m pytest -v -p no:cacheprovider -m gpu -o addopts="" tests/kernels/test_mosaic_gpu_phase2.py tests/kernels/test_mosaic_gpu_inputs.py > $OUT/pytest_gpu.txt 2>&1; echo "pytest rc=$? $(( $(date +%s)-S ))s"; grep -E "PASS|FAIL|ERROR|passed|failed" $OUT/pytest_gpu.txt | cut -c1-200 | tail -6
timeout 110 python3 -m pallas_kernels.depth_attention.bench --backward pallas > $OUT/bench.txt 2>&1; echo "bench rc=$?"; grep -v "^{" $OUT/bench.txt | grep -E "fwd|copy" | tail -6
