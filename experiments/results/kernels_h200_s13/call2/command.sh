#!/bin/bash
# Session 13, call 2: the fixed GPU test of save_read_outputs; AttnRes A/B; phase 1's dq products with the X6 algorithm (A/B).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
P="--steps 2 --warmup 1 --top 40 --set model.residual.implementation=auto"
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_model_kernel_path.py -k saved_read -o addopts="" > $OUT/gpu_test_saved.txt 2>&1; echo "gpu test rc=$? $(( $(date +%s)-S ))s"; grep -E "Counter|passed|failed" $OUT/gpu_test_saved.txt | tail -3
run() { local name=$1 cfg=$2 lim=$3; shift 3; S=$(date +%s)
  timeout $lim python3 experiments/profile_step.py configs/$cfg.py:size=base $P "$@" --json $OUT/profile_$name.json > $OUT/profile_$name.txt 2>&1
  echo "$name rc=$? $(( $(date +%s)-S ))s"; grep -E "median|memory" $OUT/profile_$name.txt; }
run attnres attnres 70
run attnres_save attnres 70 --set model.save_read_outputs=true
run msar_save msar 110 --set model.save_read_outputs=true
cp pallas_kernels/depth_attention/fused_bwd_phase1.py /tmp/orig_p1.py
cp gpu_jobs/s13/fused_bwd_phase1_x6.py pallas_kernels/depth_attention/fused_bwd_phase1.py
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_fused_bwd_phase1.py -o addopts="" > $OUT/gpu_test_x6.txt 2>&1; echo "x6 gpu test rc=$? $(( $(date +%s)-S ))s"; grep -E "Error|passed|failed" $OUT/gpu_test_x6.txt | tail -4
run msar_save_x6 msar 110 --set model.save_read_outputs=true
cp /tmp/orig_p1.py pallas_kernels/depth_attention/fused_bwd_phase1.py
for f in msar_save msar_save_x6; do echo $f; python3 - $OUT/profile_$f.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))[0]
print({k: round(v, 1) for k, v in d["parts"].items() if k.startswith("depth_begin_block")})
print(sorted(((round(o["ms_per_step"], 2), o["op"]) for o in d["top_ops"] if o["part"] == "depth_begin_block" and o["pass"] == "backward" and o["kind"] != "pallas"), reverse=True)[:6])
PY
done
cd $OUT && tar czf results.tgz --exclude=results.tgz . && find . -type f ! -name results.tgz -delete; ls $OUT
