#!/bin/bash
# Session 14, call 2: the query-gradient split by bit masks (exact on the GPU too); bench table; base profiles.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
P="--steps 2 --warmup 1 --top 40 --set model.residual.implementation=auto"
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/kernels/test_fused_bwd_phase1.py tests/test_mechanism_properties.py -k "query_grads or bf16_parts or same_bits" > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc=$? $(( $(date +%s)-S ))s"; tail -3 $OUT/gpu_tests.txt
S=$(date +%s)
timeout 120 python3 experiments/results/kernels_h200_s14/call1/qg_ab.py gpu_jobs/fbp1_old.py > $OUT/qg_ab.txt 2>&1; echo "qg_ab rc=$? $(( $(date +%s)-S ))s"; tail -4 $OUT/qg_ab.txt
S=$(date +%s)
timeout 170 python3 -m pallas_kernels.depth_attention.bench --backward pallas > $OUT/bench.txt 2>&1; echo "bench rc=$? $(( $(date +%s)-S ))s"; grep -v "^{" $OUT/bench.txt | tail -12
run() { local name=$1 cfg=$2 lim=$3; shift 3; S=$(date +%s); J=/tmp/profile_$name.json; [ $name = msar_save ] && J=$OUT/profile_$name.json
  timeout $lim python3 experiments/profile_step.py configs/$cfg.py:size=base $P "$@" --json $J > $OUT/profile_$name.txt 2>&1
  echo "$name rc=$? $(( $(date +%s)-S ))s"; grep -E "median|memory" $OUT/profile_$name.txt; }
run msar_save msar 130 --set model.save_read_outputs=true
grep -A12 "Pallas kernel" $OUT/profile_msar_save.txt
run msar msar 130
run attnres attnres 80
