#!/bin/bash
# Session 20 (2026-12-03), call 6: the per-kernel windows (KERNEL_WINDOWS: the mixing pass and phase 2's backward kernel "single", the others "aligned"): the base step profile and the per-sublayer main table.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
timeout 150 python3 experiments/profile_step.py configs/msar.py:size=base --steps 2 --warmup 1 --top 40 --set model.residual.implementation=auto > $OUT/profile_msar.txt 2>&1; echo "profile rc=$? $(( $(date +%s)-S ))s"; sed -n "4,6p;30,44p" $OUT/profile_msar.txt | cut -c1-150
S=$(date +%s)
OUT=$OUT timeout 220 python3 -m pallas_kernels.depth_attention.bench --backward pallas > $OUT/bench.txt 2>&1; echo "bench rc=$? $(( $(date +%s)-S ))s"; grep -v "^{" $OUT/bench.txt | tail -12
