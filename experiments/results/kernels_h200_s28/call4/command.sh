#!/bin/bash
# Session 28, call 4: MHAR's `base` step (one stream, 8 heads: the same phase-2 kernels as AttnRes)
# with the bf16 h, cotangent and partial gradient (calls 1-2), and Vanilla's in the same call.
# Run from the repository root with carry [".whl"].
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
for c in mhar vanilla; do
  python experiments/profile_step.py configs/$c.py:size=base --steps 2 --warmup 1 --top 30 \
    --set model.residual.implementation=auto 2>&1 | grep -v Warning | tee $OUT/profile_$c.txt
done
