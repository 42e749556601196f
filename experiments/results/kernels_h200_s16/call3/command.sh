#!/bin/bash
# Session 16, call 3: GPU test of the Mosaic phase 2; bench main table (issue shape, per sublayer); the forward alone at both shapes.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="" tests/kernels/test_mosaic_gpu_phase2.py > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc=$? $(( $(date +%s)-S ))s"; tail -3 $OUT/gpu_tests.txt
S=$(date +%s)
OUT=$OUT timeout 170 python3 -m pallas_kernels.depth_attention.bench --backward pallas > $OUT/bench.txt 2>&1; echo "bench rc=$? $(( $(date +%s)-S ))s"; grep -v "^{" $OUT/bench.txt | tail -10
S=$(date +%s)
timeout 110 python3 experiments/mgpu/time_phase2.py > $OUT/time_phase2.txt 2>&1; echo "time_phase2 rc=$? $(( $(date +%s)-S ))s"; grep -v "^W\|^E\|Warn" $OUT/time_phase2.txt | tail -16
