#!/bin/bash
# Session 28, call 5: phase 1's Mosaic scoring pass carrying only the current head's dots (MHAR's
# 8 heads). GPU tests (the scoring pass against Triton's; the single-stream reads with 1 and 8
# heads), the scoring pass alone for MHAR and AttnRes, and MHAR's `base` step, each before (the
# change reverted in a copy of the tree, gpu_jobs/s28_heads.patch) and after on the same machine.
# Run from the repository root with carry [".whl", "gpu_jobs"].
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
NEW=$PWD
OLD=/tmp/old && rm -rf $OLD && cp -r $NEW $OLD && (cd $OLD && patch -s -R -p1 < gpu_jobs/s28_heads.patch)
JAX_PLATFORMS=cuda PYTHONPATH=/tmp/site:$NEW python -m pytest -q -m gpu -o addopts="" \
  tests/kernels/test_mosaic_gpu_phase1.py::test_gpu_phase1_scores_match_triton \
  tests/kernels/test_mosaic_gpu_single_stream.py -k "scores or reads_match" 2>&1 | tail -15 | tee $OUT/gpu_tests.txt
for tree in OLD NEW; do
  dir=${!tree}
  (cd $dir && PYTHONPATH=/tmp/site:$dir:$dir/experiments/mgpu python experiments/mgpu/time_phase1_scores.py --attnres \
     --heads 8 --base-only 2>&1 | grep -v Warning | tee $OUT/scores_mhar_$tree.txt)
done
(cd $NEW && PYTHONPATH=/tmp/site:$NEW:$NEW/experiments/mgpu python experiments/mgpu/time_phase1_scores.py --attnres \
   --base-only 2>&1 | grep -v Warning | tee $OUT/scores_attnres_NEW.txt)
for tree in OLD NEW; do
  dir=${!tree}
  (cd $dir && PYTHONPATH=/tmp/site:$dir:$dir/experiments/mgpu python experiments/profile_step.py configs/mhar.py:size=base \
     --steps 2 --warmup 1 --top 30 --set model.residual.implementation=auto 2>&1 | grep -v Warning | tee $OUT/profile_mhar_$tree.txt)
done
