#!/bin/bash
# Session 12, call 3: at the committed W layout (5314174): bench main table; base AttnRes; base MSAR repeat.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
P="--steps 2 --warmup 1 --top 40 --set model.residual.implementation=auto"
S=$(date +%s)
timeout 170 python3 -m pallas_kernels.depth_attention.bench --backward pallas > $OUT/bench.txt 2>&1; echo "bench rc=$? $(( $(date +%s)-S ))s"; grep -v "^{" $OUT/bench.txt | tail -14
cp -f bench_log.jsonl $OUT/ 2>/dev/null; ls pallas_kernels/depth_attention/*.jsonl 2>/dev/null
S=$(date +%s)
timeout 90 python3 experiments/profile_step.py configs/attnres.py:size=base $P --json $OUT/profile_attnres.json > $OUT/profile_attnres.txt 2>&1; echo "attnres rc=$? $(( $(date +%s)-S ))s"; grep -E "median|memory" $OUT/profile_attnres.txt
S=$(date +%s)
timeout 130 python3 experiments/profile_step.py configs/msar.py:size=base $P --json $OUT/profile_msar.json > $OUT/profile_msar.txt 2>&1; echo "msar rc=$? $(( $(date +%s)-S ))s"; grep -E "median|memory" $OUT/profile_msar.txt
grep -A12 "Pallas kernel" $OUT/profile_msar.txt
