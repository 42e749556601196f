#!/bin/bash
# Session 13, call 1: model.save_read_outputs (the blocks' re-run reuses each sublayer's input).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
P="--steps 2 --warmup 1 --top 40 --set model.residual.implementation=auto"
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_model_kernel_path.py -k saved_read -o addopts="" > $OUT/gpu_test.txt 2>&1; echo "gpu test rc=$? $(( $(date +%s)-S ))s"; tail -4 $OUT/gpu_test.txt
run() { local name=$1 cfg=$2 lim=$3; shift 3; S=$(date +%s)
  timeout $lim python3 experiments/profile_step.py configs/$cfg.py:size=base $P "$@" --json $OUT/profile_$name.json > $OUT/profile_$name.txt 2>&1
  echo "$name rc=$? $(( $(date +%s)-S ))s"; grep -E "median|memory" $OUT/profile_$name.txt; }
run msar_save msar 130 --set model.save_read_outputs=true
grep -A12 "Pallas kernel" $OUT/profile_msar_save.txt
run msar msar 130
run vanilla vanilla 80
run attnres_save attnres 80 --set model.save_read_outputs=true
run msar_save_bf16 msar 130 --set model.save_read_outputs=true --set model.residual.state_dtype=bfloat16
