#!/bin/bash
# Session 14, call 1: phase 1's query-gradient products on bf16 sources, one product for all streams.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
P="--steps 2 --warmup 1 --top 40 --set model.residual.implementation=auto"
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/kernels/test_fused_bwd_phase1.py -k "query_grads or gpu_triton" > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc=$? $(( $(date +%s)-S ))s"; tail -3 $OUT/gpu_tests.txt
S=$(date +%s)
timeout 120 python3 experiments/results/kernels_h200_s14/call1/qg_ab.py gpu_jobs/fbp1_old.py > $OUT/qg_ab.txt 2>&1; echo "qg_ab rc=$? $(( $(date +%s)-S ))s"; cat $OUT/qg_ab.txt | tail -4
run() { local name=$1 cfg=$2 lim=$3; shift 3; S=$(date +%s); J=/tmp/profile_$name.json; [ $name = msar_save ] && J=$OUT/profile_$name.json
  timeout $lim python3 experiments/profile_step.py configs/$cfg.py:size=base $P "$@" --json $J > $OUT/profile_$name.txt 2>&1
  echo "$name rc=$? $(( $(date +%s)-S ))s"; grep -E "median|memory" $OUT/profile_$name.txt; }
run msar_save msar 130 --set model.save_read_outputs=true
grep -A12 "Pallas kernel" $OUT/profile_msar_save.txt
python3 - $OUT/profile_msar_save.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))[0]
for o in d["top_ops"]:
    if o["part"] == "depth_begin_block" and o["pass"] == "backward" and o["kind"] != "pallas" and o["ms_per_step"] > 0.2:
        print(f'{o["op"]:40s} {o["kind"]:12s} {o["ms_per_step"]:8.3f}')
PY
run msar msar 130
run vanilla vanilla 80
run attnres attnres 80
