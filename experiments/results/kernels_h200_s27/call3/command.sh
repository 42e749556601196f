#!/bin/bash
# Session 27, call 3: phase 2's forward chunks with Triton's as the baseline, AttnRes's phase-2
# backward state pass with wider chunks (call 2's run stopped on a bug in the script), AttnRes's
# per-sublayer bench, and the `base` steps of AttnRes, Vanilla and MSAR with the scoring pass's
# new chunks. Run from the repository root.
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
python experiments/mgpu/time_phase2.py --chunks 2>&1 | grep -v Warning | tee $OUT/phase2_forward_chunks.txt
python experiments/mgpu/time_phase2.py --backward --chunks --attnres 2>&1 | grep -v Warning | tee $OUT/phase2_backward_attnres_chunks.txt
python -m pallas_kernels.depth_attention.bench --backward pallas --configs attnres 2>&1 | grep -v Warning | tail -30 | tee $OUT/bench_attnres.txt
for c in attnres vanilla msar; do
  python experiments/profile_step.py configs/$c.py:size=base --steps 2 --warmup 1 --top 30 \
    --set model.residual.implementation=auto 2>&1 | grep -v Warning | tee $OUT/profile_$c.txt
done
