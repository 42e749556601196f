#!/bin/bash
# Session 34, call 1: session 33's untested default (gdots and dstreams carrying their next item)
# under its GPU tests; the MSAR `base` step with today's defaults (whole profile header: the
# median step time) and Vanilla's in the same call; then experiments/mgpu/cluster_probe.py (clusters of 2-16 CTAs sharing
# per-token sums through st.async: What remains 3). Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
S=$(date +%s)
env JAX_PLATFORMS=cuda timeout 200 python -m pytest -q -m gpu -p no:cacheprovider --tb=short \
    tests/kernels/test_mosaic_gpu_bwd1.py 2>&1 | grep -v Warning | tail -15 | tee $OUT/gpu_tests.txt
echo "tests $(( $(date +%s)-S ))s"; S=$(date +%s)
timeout 150 python experiments/mgpu/cluster_probe.py 2>&1 | grep -v Warning | tee $OUT/cluster_probe.txt
echo "probe $(( $(date +%s)-S ))s"; S=$(date +%s)
for c in msar vanilla; do
  timeout 200 python experiments/profile_step.py configs/$c.py:size=base --steps 2 --warmup 1 --top 12 \
      --set model.residual.implementation=auto 2>&1 | grep -v Warning > $OUT/step_$c.txt
  echo "step $c $(( $(date +%s)-S ))s"; S=$(date +%s); head -12 $OUT/step_$c.txt
done
