#!/bin/bash
# Session 30, call 3: AttnRes's `base` step with the value channel and without it
# (gpu_jobs/s30_no_channel.patch applied in a copy: the model passes no channel), then phase 1's
# one-stream backward kernels with a bf16 g_A (the channel's dh) in each variant of
# time_phase1_bwd.py --attnres. Run from the repository root with carry [".whl", "gpu_jobs"].
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
NEW=$PWD
rm -rf /tmp/old && cp -r $NEW /tmp/old && (cd /tmp/old && patch -p1 < gpu_jobs/s30_no_channel.patch)
export PYTHONUNBUFFERED=1
run() { (cd $1 && PYTHONPATH=/tmp/site:$1:$1/experiments/mgpu "${@:2}"); }
for tree in $NEW /tmp/old; do
  run $tree timeout 240 python experiments/profile_step.py configs/attnres.py:size=base --steps 2 --warmup 1 --top 12 --set model.residual.implementation=auto 2>&1 | grep -v Warning | tee $OUT/step_attnres_$(basename $tree).txt
done
run $NEW timeout 200 python experiments/mgpu/time_phase1_bwd.py --attnres --ga_bf16 2>&1 | grep -v Warning | tee $OUT/phase1_bwd_ga_bf16.txt
