#!/bin/bash
# Session 17, call 3: the main table (issue shape, fwd + bwd as value_and_grad) with auto's Mosaic backward kernel; the Vanilla base step.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
OUT=$OUT timeout 170 python3 -m pallas_kernels.depth_attention.bench --backward pallas > $OUT/bench.txt 2>&1; echo "bench rc=$? $(( $(date +%s)-S ))s"; grep -v "^{" $OUT/bench.txt | tail -12
S=$(date +%s)
timeout 150 python3 experiments/profile_step.py configs/vanilla.py:size=base --steps 2 --warmup 1 --top 10 > $OUT/profile_vanilla.txt 2>&1; echo "profile rc=$? $(( $(date +%s)-S ))s"; sed -n "4,6p" $OUT/profile_vanilla.txt | cut -c1-150
