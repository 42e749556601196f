#!/bin/bash
# Session 40, call 1: phase 2's backward input kernel with its per-channel constants per use, per
# tile and held per program (mosaic_gpu.INPUTS_CONSTANTS), and phase 1's expansion transpose with
# its windows widened per lag / once per tile and its taps per tile / held per source
# (mosaic_gpu_bwd1.TRANSPOSE_WIDEN / TRANSPOSE_TAPS), `base` and the issue's shape; then the GPU
# tests of both kernels (the options against Triton's passes and the defaults). Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv
timeout 330 python experiments/mgpu/time_inner_loops.py 2>&1 | grep -v Warning | tee $OUT/inner_loops.txt
JAX_PLATFORMS=cuda timeout 200 python -m pytest -q -m gpu tests/kernels/test_mosaic_gpu_inputs.py \
    tests/kernels/test_mosaic_gpu_bwd1.py -p no:cacheprovider 2>&1 | grep -v Warning | tail -15 | tee $OUT/gpu_test.txt
