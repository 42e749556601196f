#!/bin/bash
# Session 46, call 2: the census of every Mosaic kernel at the issue's shape with today's defaults
# (session 44's call 3 had the defaults before "in_scores", the split programs and the rows per
# (head, stream)), its figure, and MSAR's per-sublayer bench on the same machine. Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
M=$(python3 experiments/mgpu/ncu_census.py --metrics)
S=$(date +%s)
for p in 2 1; do
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 ncu --clock-control none -k regex:mosaic --csv --print-units base \
      --metrics $M python3 experiments/mgpu/ncu_phase$p.py --issue > $OUT/ncu_p${p}_issue.csv 2>> $OUT/ncu.err
  echo "ncu phase $p rc $? $(( $(date +%s)-S ))s"
done
timeout 240 python -m pallas_kernels.depth_attention.bench --backward pallas --configs msar 2>&1 | grep -v Warning \
    | tail -8 > $OUT/bench_msar.txt
grep -E "copy bandwidth|fwd:|fb:" $OUT/bench_msar.txt
echo "bench $(( $(date +%s)-S ))s"
C=$(grep -m1 -o "copy bandwidth [0-9.]*" $OUT/bench_msar.txt | awk '{print $3}')
python3 experiments/mgpu/ncu_census.py $OUT/ncu_p1_issue.csv $OUT/ncu_p2_issue.csv --copy-tbps ${C:-2.8} --skip 'mix#2' \
    --per-sublayer 8 | tee $OUT/census.txt
