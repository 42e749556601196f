#!/bin/bash
# Session 38, call 1: which cluster exchange works (session 37: the push form's sums were off by 2
# at G = 2 and its later launches faulted; a failed launch leaves the process's GPU unusable, so
# every variant runs in its own process), the cluster forward and backward state pass timed with
# the pull exchange, then the GPU tests (JAX_PLATFORMS=cuda: the tests' conftest defaults to the
# CPU). Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
FILTER="Warning\|cuda_stream\|cuda_event\|Source Location\|cuda_status\|cuda_host\|cuda_device\|^$"
S=$(date +%s)
# pull with the cluster fences (session 38) at three sizes, and without them at G = 8
for args in "--cols 8 --only 2" "--cols 8 --only 8" "--cols 8 --only 16" "--cols 8 --only 8 --no-fence"; do
  timeout 25 python experiments/mgpu/cluster_probe.py --mode pull $args 2>&1 | grep -v "$FILTER" \
      | tail -4 | tee -a $OUT/cluster_probe.txt
done
echo "probes $(( $(date +%s)-S ))s"; S=$(date +%s)
# the cluster forward (exchange="pull", two warpgroups per CTA; one cluster per tile and walking),
# the one-CTA kernel beside each: `base` with clusters of 8, both shapes with 16
timeout 60 python experiments/mgpu/time_cluster_forward.py --base-only --only "cluster  8 pull      2 wg" 2>&1 \
    | grep -v "$FILTER" | tail -4 | tee -a $OUT/cluster_forward.txt
timeout 75 python experiments/mgpu/time_cluster_forward.py --only "cluster 16 pull      2 wg" 2>&1 \
    | grep -v "$FILTER" | tail -10 | tee -a $OUT/cluster_forward.txt
echo "cluster forward $(( $(date +%s)-S ))s"; S=$(date +%s)
# the backward's state pass on clusters (session 38; one and two warpgroups per CTA, one cluster per tile and walking)
timeout 110 python experiments/mgpu/time_cluster_forward.py --backward 2>&1 \
    | grep -v "$FILTER" | tail -14 | tee -a $OUT/cluster_backward.txt
echo "cluster backward $(( $(date +%s)-S ))s"; S=$(date +%s)
env JAX_PLATFORMS=cuda timeout 100 python -m pytest -q -m gpu -p no:cacheprovider --tb=short -k one_cta_cluster \
    tests/kernels/test_mosaic_gpu_cluster.py 2>&1 | tail -20 | tee $OUT/gpu_test.txt
# clusters of 8 and 16 with the pull exchange against the one-CTA kernels, forward and backward
env JAX_PLATFORMS=cuda timeout 150 python -m pytest -q -m gpu -p no:cacheprovider --tb=short \
    -k "pull_cluster or backward_state_cluster" tests/kernels/test_mosaic_gpu_cluster.py 2>&1 | tail -30 \
    | tee $OUT/gpu_test_pull.txt
echo "gpu tests $(( $(date +%s)-S ))s"
