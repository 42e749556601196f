#!/bin/bash
# Session 47, call 1: the copy ceiling measured four ways (experiments/mgpu/copy_ceiling.py); then
# on an H200 session 45's call 1 (the per-sublayer bench of MSAR and AttnRes, the `base` steps of
# Vanilla, MSAR and AttnRes with today's defaults), on any other card session 46's call 6 (phase 1's
# kernels under Nsight Compute at the issue's shape, without and with the L2 eviction hints), after
# one stream's phase-2 forward with its Triton calls on launch parameters of their own
# (time_phase2.py --call-params).
# Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem,power.limit --format=csv | tee $OUT/gpu.txt
S=$(date +%s)
timeout 120 python3 experiments/mgpu/copy_ceiling.py 2>&1 | grep -v Warning | tee $OUT/copy_ceiling.txt
echo "copy $(( $(date +%s)-S ))s"
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  for c in msar attnres; do
    timeout 200 python -m pallas_kernels.depth_attention.bench --backward pallas --configs $c 2>&1 | grep -v Warning \
        | tail -8 > $OUT/bench_$c.txt
    grep -E "fwd:|fb:" $OUT/bench_$c.txt
    echo "bench $c $(( $(date +%s)-S ))s"
  done
  ARGS="--steps 2 --warmup 1 --top 8 --set model.residual.implementation=auto"
  for c in vanilla msar attnres; do
    timeout 130 python experiments/profile_step.py configs/$c.py:size=base $ARGS 2>&1 | grep -v Warning > $OUT/step_$c.txt
    grep -m1 "median wall" $OUT/step_$c.txt | sed "s/^/$c: /"
    echo "step $c $(( $(date +%s)-S ))s"
  done
  exit 0
fi
timeout 150 python3 experiments/mgpu/time_phase2.py --call-params --attnres-only 2>&1 | grep -v Warning \
    | tee $OUT/time_call_params.txt
echo "call params $(( $(date +%s)-S ))s"
M=$(python3 experiments/mgpu/ncu_census.py --metrics)
BOTH=stores=evict_first,large_f32_loads=evict_first,bf16_loads=evict_last,f32_rank5_loads=evict_last
for label in none hinted; do
  extra=$([ $label = hinted ] && echo "--l2-hints $BOTH")
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 ncu --clock-control none -k regex:mosaic --csv --print-units base \
      --metrics $M python3 experiments/mgpu/ncu_phase1.py --issue $extra > $OUT/ncu_p1_issue_$label.csv 2>> $OUT/ncu.err
  echo "ncu $label rc $? $(( $(date +%s)-S ))s"
  python3 experiments/mgpu/ncu_census.py $OUT/ncu_p1_issue_$label.csv --copy-tbps 2.83 --skip 'mix#2' | tee $OUT/census_$label.txt
done
