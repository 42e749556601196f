#!/bin/bash
# Session 28, call 1: phase 2's h stored in the activations' dtype (out_dtype) and its bf16
# cotangent read as it is by the backward kernels. GPU tests, then the `base` steps of AttnRes and
# MSAR before (the change reverted in a copy of the tree, gpu_jobs/s28_bf16_h.patch) and after on
# the same machine, and Vanilla's. Run from the repository root with carry [".whl", "gpu_jobs"].
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
NEW=$PWD
OLD=/tmp/old && rm -rf $OLD && cp -r $NEW $OLD && (cd $OLD && patch -s -R -p1 < gpu_jobs/s28_bf16_h.patch)
JAX_PLATFORMS=cuda PYTHONPATH=/tmp/site:$NEW python -m pytest -q -m gpu -o addopts="" \
  tests/kernels/test_bf16_output.py tests/kernels/test_mosaic_gpu_phase2.py tests/kernels/test_mosaic_gpu_single_stream.py \
  -k "bf16 or gpu_mosaic_matches or auto_matches" 2>&1 | tail -15 | tee $OUT/gpu_tests.txt
profile() {  # tree config label
  (cd $1 && PYTHONPATH=/tmp/site:$1:$1/experiments/mgpu python experiments/profile_step.py configs/$2.py:size=base \
     --steps 2 --warmup 1 --top 30 --set model.residual.implementation=auto 2>&1 | grep -v Warning | tee $OUT/profile_$3.txt)
}
profile $OLD attnres attnres_before
profile $NEW attnres attnres
profile $NEW vanilla vanilla
profile $OLD msar msar_before
profile $NEW msar msar
