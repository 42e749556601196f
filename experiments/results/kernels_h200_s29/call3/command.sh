#!/bin/bash
# Session 29, call 3: the main table at the shape (MSAR and AttnRes, the Pallas backward)
# as the bench now times it (forward + backward in the vjp form, 20 calls per timed repetition),
# then as sessions 16-28 did (5 and 2 calls per repetition, the loss form), both with phase 2's
# grouped input pass (call 2). Run from the repository root with carry [".whl"].
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python -m pallas_kernels.depth_attention.bench --backward pallas 2>&1 | grep -v Warning | tail -12 | tee $OUT/bench.txt
python -m pallas_kernels.depth_attention.bench --backward pallas --inner 5 --inner_fb 2 --fb_forms loss 2>&1 | grep -v Warning | tail -12 | tee $OUT/bench_s28_method.txt
