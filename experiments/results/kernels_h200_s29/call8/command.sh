#!/bin/bash
# Session 29, call 8: MHAR with phase 1's backward in heads-major order: its `base` step with and
# without (gpu_jobs/s29_heads_major.patch reverted in a copy), its row of the main table, and the
# GPU tests of the single-stream reads with 8 heads. Run from the repository root with carry
# [".whl", "gpu_jobs"].
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
NEW=$PWD
rm -rf /tmp/old && cp -r $NEW /tmp/old && (cd /tmp/old && patch -R -p1 < gpu_jobs/s29_heads_major.patch)
export PYTHONUNBUFFERED=1
run() { (cd $1 && PYTHONPATH=/tmp/site:$1:$1/experiments/mgpu "${@:2}"); }
run $NEW env JAX_PLATFORMS=cuda python -m pytest -q -m gpu tests/kernels/test_mosaic_gpu_single_stream.py -k mhar 2>&1 | tail -4 | tee $OUT/gpu_tests.txt
for tree in $NEW /tmp/old; do
  run $tree python experiments/profile_step.py configs/mhar.py:size=base --steps 2 --warmup 1 --top 12 --set model.residual.implementation=auto 2>&1 | grep -v Warning | tee $OUT/step_$(basename $tree).txt
done
run $NEW python -m pallas_kernels.depth_attention.bench --backward pallas --configs mhar 2>&1 | grep -v Warning | tail -6 | tee $OUT/bench.txt
