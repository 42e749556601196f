#!/bin/bash
# Session 29, call 2: (a) the device time per op, ops and span per call of the bench's AttnRes and
# MSAR reads, and each timed with 1, 2, 5 and 20 calls per repetition; (b) the same profile for
# AttnRes without the token groups of phase 2's input pass (gpu_jobs/s29_groups.patch reverted in a
# copy); (c) the GPU tests of the grouped input pass; (d) AttnRes's `base` step with and without.
# Run from the repository root with carry [".whl", "gpu_jobs"].
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
NEW=$PWD
rm -rf /tmp/old && cp -r $NEW /tmp/old && (cd /tmp/old && patch -R -p1 < gpu_jobs/s29_groups.patch)
export PYTHONUNBUFFERED=1
run() { (cd $1 && PYTHONPATH=/tmp/site:$1:$1/experiments/mgpu "${@:2}"); }
run $NEW python experiments/mgpu/profile_bench_reads.py --configs attnres,msar --inners 1,2,5,20 2>&1 | grep -v Warning | tee $OUT/profile_new.txt
run /tmp/old python experiments/mgpu/profile_bench_reads.py --configs attnres 2>&1 | grep -v Warning | tee $OUT/profile_old.txt
run $NEW env JAX_PLATFORMS=cuda python -m pytest -q -m gpu tests/kernels/test_fused_bwd_phase2.py -k groups 2>&1 | tail -5 | tee $OUT/gpu_tests.txt
for tree in $NEW /tmp/old; do
  run $tree python experiments/profile_step.py configs/attnres.py:size=base --steps 2 --warmup 1 --top 12 --set model.residual.implementation=auto 2>&1 | grep -v Warning | tee -a $OUT/step_$(basename $tree).txt
done
