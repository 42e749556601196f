#!/bin/bash
# Session 38 plan, call 1: which cluster exchange works (session 37: the push form's sums were
# off by 2 at G = 2 and its later launches faulted; a failed launch leaves the process's GPU
# unusable, so every variant runs in its own process), then the cluster kernel's one-CTA path on
# the GPU (JAX_PLATFORMS=cuda: the tests' conftest defaults to the CPU). Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
S=$(date +%s)
# pull with the cluster fences (session 38) at both widths and three sizes, pull without them at
# G = 8, push at 32 columns
for args in "pull --cols 8 --only 2" "pull --cols 8 --only 8" "pull --cols 8 --only 16" "pull --cols 32 --only 8" \
            "pull --cols 8 --only 8 --no-fence" "push --cols 32 --only 2" "push --cols 32 --only 8"; do
  timeout 25 python experiments/mgpu/cluster_probe.py --mode $args 2>&1 \
      | grep -v "Warning\|cuda_stream\|cuda_event\|Source Location\|cuda_status\|cuda_host\|cuda_device\|^$" \
      | tail -4 | tee -a $OUT/cluster_probe.txt
done
echo "probes $(( $(date +%s)-S ))s"; S=$(date +%s)
# the cluster forward with the pull exchange (mosaic_gpu_cluster, exchange="pull"), one variant per
# process, the one-CTA kernel beside each
for v in "cluster  8 pull      2 wg"; do  # its walking form too
  timeout 60 python experiments/mgpu/time_cluster_forward.py --base-only --only "$v" 2>&1 \
      | grep -v "Warning\|cuda_stream\|cuda_event\|Source Location\|cuda_status\|cuda_host\|cuda_device\|^$" \
      | tail -4 | tee -a $OUT/cluster_forward.txt
done
timeout 60 python experiments/mgpu/time_cluster_forward.py --only "cluster 16 pull      2 wg" 2>&1 \
    | grep -v "Warning\|cuda_stream\|cuda_event\|Source Location\|cuda_status\|cuda_host\|cuda_device\|^$" \
    | tail -10 | tee -a $OUT/cluster_forward.txt
echo "cluster forward $(( $(date +%s)-S ))s"; S=$(date +%s)
env JAX_PLATFORMS=cuda timeout 120 python -m pytest -q -m gpu -p no:cacheprovider --tb=short -k one_cta_cluster \
    tests/kernels/test_mosaic_gpu_cluster.py 2>&1 | tail -20 | tee $OUT/gpu_test.txt
# clusters of 8 and 16 with the pull exchange against the one-CTA kernel (a process of its own)
env JAX_PLATFORMS=cuda timeout 150 python -m pytest -q -m gpu -p no:cacheprovider --tb=short -k pull_cluster \
    tests/kernels/test_mosaic_gpu_cluster.py 2>&1 | tail -30 | tee $OUT/gpu_test_pull.txt
echo "gpu test $(( $(date +%s)-S ))s"
