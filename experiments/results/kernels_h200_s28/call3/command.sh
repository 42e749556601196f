#!/bin/bash
# Session 28, call 3: per sublayer at the shape (MSAR and AttnRes, the Pallas backward)
# with phase 2's bf16 cotangent and partial gradient (calls 1-2). Run from the repository root
# with carry [".whl"].
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python -m pallas_kernels.depth_attention.bench --backward pallas 2>&1 | grep -v Warning | tail -12 | tee $OUT/bench.txt
