#!/bin/bash
# Session 15, call 1: phase 2's backward in two recompute passes (channel-sum products; inputs write d_acc).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
P="--steps 2 --warmup 1 --top 40 --set model.residual.implementation=auto"
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="" tests/kernels/test_fused_bwd_phase2.py tests/kernels/test_depth_attention_fused.py > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc=$? $(( $(date +%s)-S ))s"; tail -3 $OUT/gpu_tests.txt
S=$(date +%s)
timeout 150 python3 experiments/results/kernels_h200_s15/p2_fold_ab.py gpu_jobs/fbp2_old.py > $OUT/p2_fold_ab.txt 2>&1; echo "ab rc=$? $(( $(date +%s)-S ))s"; grep -v "^W\|^E\|Warn" $OUT/p2_fold_ab.txt | tail -8
run() { local name=$1 cfg=$2 lim=$3; shift 3; S=$(date +%s); J=/tmp/profile_$name.json; [ $name = msar_save ] && J=$OUT/profile_$name.json
  timeout $lim python3 experiments/profile_step.py configs/$cfg.py:size=base $P "$@" --json $J > $OUT/profile_$name.txt 2>&1
  echo "$name rc=$? $(( $(date +%s)-S ))s"; grep -E "median|memory" $OUT/profile_$name.txt; }
run msar msar 130
grep -A12 "Pallas kernel" $OUT/profile_msar.txt
run msar_save msar 130 --set model.save_read_outputs=true
run attnres attnres 80
