#!/bin/bash
# Session 28, call 2: the bf16 partial's gradient written in bf16 by phase 2's backward kernels
# (Triton's input pass, Mosaic's input kernel, the wide form's transpose). GPU tests, then the
# `base` steps of AttnRes and MSAR before (the change reverted in a copy of the tree,
# gpu_jobs/s28_bf16_dx.patch) and after on the same machine, and Vanilla's. Run from the
# repository root with carry [".whl", "gpu_jobs"].
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
NEW=$PWD
OLD=/tmp/old && rm -rf $OLD && cp -r $NEW $OLD && (cd $OLD && patch -s -R -p1 < gpu_jobs/s28_bf16_dx.patch)
JAX_PLATFORMS=cuda PYTHONPATH=/tmp/site:$NEW python -m pytest -q -m gpu -o addopts="" \
  tests/kernels/test_bf16_output.py tests/kernels/test_fused_bwd_phase2.py \
  "tests/kernels/test_mosaic_gpu_inputs.py::test_gpu_inputs_kernel_matches_the_triton_pass[2-True-4-320]" \
  2>&1 | tail -15 | tee $OUT/gpu_tests.txt
profile() {  # tree config label
  (cd $1 && PYTHONPATH=/tmp/site:$1:$1/experiments/mgpu python experiments/profile_step.py configs/$2.py:size=base \
     --steps 2 --warmup 1 --top 30 --set model.residual.implementation=auto 2>&1 | grep -v Warning | tee $OUT/profile_$3.txt)
}
profile $OLD attnres attnres_before
profile $NEW attnres attnres
profile $NEW vanilla vanilla
profile $OLD msar msar_before
profile $NEW msar msar
