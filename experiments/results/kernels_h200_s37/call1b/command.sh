#!/bin/bash
# Session 37, call 1b (replaces call1 and call2 after failed starts cost device time), most
# wanted first: the cluster forward (mosaic_gpu_cluster, new) timed against the one-CTA kernel,
# its GPU test, the cluster probe with its barrier fixed, then the mix's --fetch-bound variants.
# Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
S=$(date +%s)
timeout 200 python experiments/mgpu/time_cluster_forward.py 2>&1 | grep -v Warning | tee $OUT/cluster_forward.txt
echo "cluster forward $(( $(date +%s)-S ))s"; S=$(date +%s)
timeout 120 python -m pytest -q -m gpu tests/kernels/test_mosaic_gpu_cluster.py 2>&1 | tail -30 | tee $OUT/gpu_test.txt
echo "gpu test $(( $(date +%s)-S ))s"; S=$(date +%s)
timeout 90 python experiments/mgpu/cluster_probe.py 2>&1 | grep -v Warning | tee $OUT/cluster_probe.txt
echo "probe $(( $(date +%s)-S ))s"; S=$(date +%s)
timeout 150 python experiments/mgpu/time_phase1_mix.py --fetch-bound 2>&1 | grep -v Warning | tee $OUT/fetch_bound.txt
echo "fetch-bound $(( $(date +%s)-S ))s"
