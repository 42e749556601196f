#!/bin/bash
# Session 30, call 2: AttnRes's reads under the profiler with phase 1 as the model runs it (value
# channel) and per target, per op; then the main table's AttnRes and MHAR rows again, the bench
# now returning no channel zeros (phase 1) and no copy of dh (phase 2's channel cotangent).
# Run from the repository root with carry [".whl"].
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
for form in value_channel per_target; do
  python experiments/mgpu/profile_bench_reads.py --configs attnres --p1_form $form --min_ms 0.01 2>&1 | grep -v Warning | tee $OUT/profile_$form.txt
done
python -m pallas_kernels.depth_attention.bench --backward pallas --configs attnres,mhar --p1_forms model,per_target 2>&1 | grep -v Warning | tail -12 | tee $OUT/bench.txt
cp bench_log.jsonl $OUT/ 2>/dev/null; true
