#!/bin/bash
# Session 29, call 4: the GPU-marked tests of phase 2's Triton backward (its input pass now has a
# third grid axis, of size 1 with a conv) and of the bf16 outputs. Run from the repository root
# with carry [".whl"].
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
python -m pytest -q -m gpu tests/kernels/test_fused_bwd_phase2.py tests/kernels/test_bf16_output.py 2>&1 | tail -8 | tee $OUT/gpu_tests.txt
