#!/bin/bash
# Session 47, call 1: the copy ceiling measured four ways (experiments/mgpu/copy_ceiling.py); then
# on an H200 session 45's call 1 (the per-sublayer bench of MSAR and AttnRes, the `base` steps of
# Vanilla, MSAR and AttnRes with today's defaults); on any other card one stream's phase-2 forward
# with its Triton calls on launch parameters of their own (time_phase2.py --call-params), then
# AttnRes's per-sublayer bench with the defaults and with its scoring call on 8 rows and 2 warps.
# (Session 46's call 6, the ncu census with L2 hints, moved to a later call.)
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
for opt in none "tiling.ONE_STREAM_PHASE2_SCORES_ROWS=8 --kernel-option tiling.ONE_STREAM_PHASE2_CALL_PARAMS=(('scores',2,1),)"; do
  label=$([ "$opt" = none ] && echo default || echo scores8w2)
  extra=$([ "$opt" = none ] || echo "--kernel-option $opt")
  timeout 150 python -m pallas_kernels.depth_attention.bench --backward pallas --configs attnres $extra 2>&1 \
      | grep -v Warning | tail -8 > $OUT/bench_attnres_$label.txt
  grep -E "fwd:|fb:" $OUT/bench_attnres_$label.txt | sed "s/^/$label /"
  echo "bench attnres $label $(( $(date +%s)-S ))s"
done
