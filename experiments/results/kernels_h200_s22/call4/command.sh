#!/bin/bash
# Session 22, call 4: the GPU-marked tests of phase 1's Mosaic kernels (mosaic_gpu_bwd1 against Triton's passes; the scoring and mixing passes and the op with gpu_kernels="mosaic").
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 200 python3 -m pytest -v -p no:cacheprovider -m gpu -o addopts="" tests/kernels/test_mosaic_gpu_bwd1.py tests/kernels/test_mosaic_gpu_phase1.py > $OUT/pytest_gpu.txt 2>&1; echo "pytest rc=$? $(( $(date +%s)-S ))s"; grep -E "PASS|FAIL|ERROR|passed|failed|Error" $OUT/pytest_gpu.txt | cut -c1-300 | tail -12
