#!/bin/bash
# Session 14, call 3: the scoring kernel in channel groups (Tiles.scores_splits).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
P="--steps 2 --warmup 1 --top 40 --set model.residual.implementation=auto"
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="" tests/kernels/test_depth_attention_fused.py tests/kernels/test_fused_bwd_phase2.py > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc=$? $(( $(date +%s)-S ))s"; tail -3 $OUT/gpu_tests.txt
S=$(date +%s)
timeout 100 python3 -m pallas_kernels.depth_attention.bench --sweeps_only --base_shape --scores_splits 1,2,4,8,16 > $OUT/splits_base.txt 2>&1; echo "splits base rc=$? $(( $(date +%s)-S ))s"; tail -1 $OUT/splits_base.txt
S=$(date +%s)
timeout 100 python3 -m pallas_kernels.depth_attention.bench --sweeps_only --scores_splits 1,2,4,8,16 > $OUT/splits_bench.txt 2>&1; echo "splits bench rc=$? $(( $(date +%s)-S ))s"; tail -1 $OUT/splits_bench.txt
S=$(date +%s)
timeout 150 python3 -m pallas_kernels.depth_attention.bench --backward pallas > $OUT/bench.txt 2>&1; echo "bench rc=$? $(( $(date +%s)-S ))s"; grep -v "^{" $OUT/bench.txt | tail -12
run() { local name=$1 cfg=$2 lim=$3; shift 3; S=$(date +%s); J=/tmp/profile_$name.json; [ $name = msar_save ] && J=$OUT/profile_$name.json
  timeout $lim python3 experiments/profile_step.py configs/$cfg.py:size=base $P "$@" --json $J > $OUT/profile_$name.txt 2>&1
  echo "$name rc=$? $(( $(date +%s)-S ))s"; grep -E "median|memory" $OUT/profile_$name.txt; }
run msar_save msar 120 --set model.save_read_outputs=true
grep -A12 "Pallas kernel" $OUT/profile_msar_save.txt
run msar msar 120
