#!/bin/bash
# Session 21 (2026-12-03), call 8: the per-sublayer main table with phase 2's input kernel in Mosaic GPU (the new "auto").
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 280 python3 -m pallas_kernels.depth_attention.bench --backward pallas > $OUT/bench.txt 2>&1; echo "bench rc=$?"; grep -v "^{" $OUT/bench.txt | tail -12
