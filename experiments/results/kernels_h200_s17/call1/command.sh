#!/bin/bash
# Session 17, call 1: the backward's Mosaic kernel (phase2_backward_state): GPU test, whole-backward timing, per-op profile, bench rows.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 220 python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="" tests/kernels/test_mosaic_gpu_phase2.py > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc=$? $(( $(date +%s)-S ))s"; tail -5 $OUT/gpu_tests.txt
S=$(date +%s)
timeout 150 python3 experiments/mgpu/time_phase2.py --backward > $OUT/time_backward.txt 2>&1; echo "time_backward rc=$? $(( $(date +%s)-S ))s"; tail -30 $OUT/time_backward.txt
S=$(date +%s)
timeout 120 python3 experiments/mgpu/time_phase2.py --profile > $OUT/profile_p2.txt 2>&1; echo "profile rc=$? $(( $(date +%s)-S ))s"; tail -60 $OUT/profile_p2.txt | cut -c1-200
S=$(date +%s)
OUT=$OUT timeout 90 python3 -m pallas_kernels.depth_attention.bench --sweeps_only --p2_gpu_kernels > $OUT/bench_p2.txt 2>&1; echo "bench p2 rc=$? $(( $(date +%s)-S ))s"; grep p2_streams $OUT/bench_p2.txt | cut -c1-300
