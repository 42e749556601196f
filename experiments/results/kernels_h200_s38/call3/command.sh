#!/bin/bash
# Session 38, call 3: the cluster forward and backward (8 CTAs, one warpgroup) with and without
# mosaic_gpu_cluster.PULL_FENCE (fence.acq_rel.cluster around the pull barrier), at `base`. Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
for fence in True False; do for mode in "" "--backward"; do
timeout 60 python -c "
import sys; sys.path[:0] = ['experiments/mgpu']
from pallas_kernels.depth_attention import mosaic_gpu_cluster
mosaic_gpu_cluster.PULL_FENCE = $fence
import time_cluster_forward as t
print('PULL_FENCE', $fence)
t.main(['--base-only', '--only', 'cluster  8 pull      1 wg'] + ('$mode'.split()))" 2>&1 | grep -v "Warning\|cuda_\|Source Loc\|^$" | tail -5 | tee -a $OUT/fence.txt
done; done
