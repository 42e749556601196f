#!/bin/bash
# Session 29, call 1: per sublayer at the shape (MSAR and AttnRes, the Pallas backward),
# forward + backward timed both ways (bench.FB_FORMS: vjp, the new default, and the loss form of
# sessions 16-28), then the device time per op of each timed function in the vjp form.
# Run from the repository root with carry [".whl"].
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
python -m pallas_kernels.depth_attention.bench --backward pallas --fb_forms vjp,loss 2>&1 | grep -v Warning | tail -14 | tee $OUT/bench.txt
python experiments/mgpu/profile_bench_reads.py --configs attnres,msar --calls 10 2>&1 | grep -v Warning | tee $OUT/profile.txt
