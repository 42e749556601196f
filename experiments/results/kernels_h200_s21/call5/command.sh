#!/bin/bash
# Session 21 (2026-12-03), calls 5-6 (6: again after the fix of a static negative window start): the GPU-marked tests of phase 2 (its three Mosaic kernels under "auto", now with the input kernel) and of the input kernel against Triton's pass.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 300 python3 -m pytest -v -p no:cacheprovider -m gpu -o addopts="" tests/kernels/test_mosaic_gpu_phase2.py tests/kernels/test_mosaic_gpu_inputs.py > $OUT/pytest_gpu.txt 2>&1; echo "pytest rc=$? $(( $(date +%s)-S ))s"; grep -E "PASS|FAIL|ERROR|passed|failed|assert" $OUT/pytest_gpu.txt | cut -c1-300 | tail -15
