#!/bin/bash
# Session 16, call 1: phase 2's fused forward as one Mosaic GPU kernel: GPU tests, the forward alone, fwd + bwd, base step.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="" tests/kernels/test_mosaic_gpu_phase2.py tests/kernels/test_depth_attention_fused.py > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc=$? $(( $(date +%s)-S ))s"; tail -5 $OUT/gpu_tests.txt
S=$(date +%s)
timeout 200 python3 experiments/mgpu/time_phase2.py > $OUT/time_phase2.txt 2>&1; echo "time_phase2 rc=$? $(( $(date +%s)-S ))s"; grep -v "^W\|^E\|Warn" $OUT/time_phase2.txt | tail -20
S=$(date +%s)
OUT=$OUT timeout 150 python3 -m pallas_kernels.depth_attention.bench --base_shape --sweeps_only --p2_gpu_kernels > $OUT/bench_p2.txt 2>&1; echo "bench rc=$? $(( $(date +%s)-S ))s"; grep p2_streams $OUT/bench_p2.txt
S=$(date +%s)
timeout 140 python3 experiments/profile_step.py configs/msar.py:size=base --steps 2 --warmup 1 --top 40 --set model.residual.implementation=auto > $OUT/profile_msar.txt 2>&1; echo "msar rc=$? $(( $(date +%s)-S ))s"; grep -E "median|memory" $OUT/profile_msar.txt; grep -A14 "Pallas kernel" $OUT/profile_msar.txt | head -16
