#!/bin/bash
# Session 16, call 4: fwd + bwd as value_and_grad (the forward's outputs kept): main table (issue shape) and phase 2 by GPU lowering.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
OUT=$OUT timeout 80 python3 -m pallas_kernels.depth_attention.bench --sweeps_only --p2_gpu_kernels > $OUT/bench_p2.txt 2>&1; echo "bench p2 rc=$? $(( $(date +%s)-S ))s"; grep p2_streams $OUT/bench_p2.txt | cut -c1-300
S=$(date +%s)
OUT=$OUT timeout 140 python3 -m pallas_kernels.depth_attention.bench --backward pallas > $OUT/bench.txt 2>&1; echo "bench rc=$? $(( $(date +%s)-S ))s"; grep -v "^{" $OUT/bench.txt | tail -10
