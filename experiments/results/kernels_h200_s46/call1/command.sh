#!/bin/bash
# Session 46, call 1: one stream's `dstreams` (AttnRes, MHAR: the value channel's bf16 g_A) with its
# per-token rows once per (head, stream) against once per item, alone, per sublayer and in the
# `base` step; then today's defaults for MSAR per sublayer and Vanilla's `base` step. Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
S=$(date +%s)
timeout 150 python experiments/mgpu/time_phase1_bwd.py --attnres --ga_bf16 --dstreams-only --rows-fetch per_item,per_stream \
    2>&1 | grep -v Warning > $OUT/time_attnres_dstreams.txt
tail -12 $OUT/time_attnres_dstreams.txt
echo "dstreams $(( $(date +%s)-S ))s"
ONE_STREAM_PER_STREAM="{'one_stream': 'per_stream', 'several': 'per_stream'}"
bench() {  # $1: label, $2: config, $3: the one-stream rows default (or "")
  timeout 150 python - "$2" "$3" <<'PY' 2>&1 | grep -v Warning | tail -8 > $OUT/bench_$1.txt
import ast, runpy, sys
from pallas_kernels.depth_attention import mosaic_gpu_bwd1
if sys.argv[2]:
    mosaic_gpu_bwd1.DEFAULT_DSTREAMS_ROWS_FETCH = ast.literal_eval(sys.argv[2])
print("rows fetch default:", mosaic_gpu_bwd1.DEFAULT_DSTREAMS_ROWS_FETCH)
sys.argv = ["bench", "--backward", "pallas", "--configs", sys.argv[1]]
runpy.run_module("pallas_kernels.depth_attention.bench", run_name="__main__")
PY
  grep -E "copy bandwidth|fwd:|fb:" $OUT/bench_$1.txt | sed "s/^/$1: /"
  echo "bench $1 $(( $(date +%s)-S ))s"
}
bench attnres_per_item attnres ""
bench attnres_per_stream attnres "$ONE_STREAM_PER_STREAM"
bench msar msar ""
ARGS="--steps 2 --warmup 1 --top 8 --set model.residual.implementation=auto"
step() {  # $1: label, $2: config, then profile_step's extra arguments
  local label=$1 config=$2; shift 2
  timeout 130 python experiments/profile_step.py configs/$config.py:size=base $ARGS "$@" 2>&1 | grep -v Warning > $OUT/step_$label.txt
  grep -m1 "median wall" $OUT/step_$label.txt | sed "s/^/$label: /"
  grep "bwd1_dstreams" $OUT/step_$label.txt | sed "s/^/$label: /"
  echo "step $label $(( $(date +%s)-S ))s"
}
step vanilla vanilla
step attnres_per_item attnres
step attnres_per_stream attnres --kernel-option "mosaic_gpu_bwd1.DEFAULT_DSTREAMS_ROWS_FETCH=$ONE_STREAM_PER_STREAM"
