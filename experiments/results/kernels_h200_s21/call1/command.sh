#!/bin/bash
# Session 21 (2026-12-03), call 1: phase 1's and phase 2's Mosaic GPU tests on the GPU with the padded windows (the default since session 20); phase 2's backward with pass 3 as the reverse-T kernel against the wide form; its Mosaic passes 1-2 with 32- and 64-channel chunks.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 240 python3 -m pytest -v -p no:cacheprovider -m gpu -o addopts="" tests/kernels/test_mosaic_gpu_phase2.py tests/kernels/test_mosaic_gpu_phase1.py > $OUT/pytest_gpu.txt 2>&1; echo "pytest rc=$? $(( $(date +%s)-S ))s"; grep -E "PASS|FAIL|ERROR|passed|failed" $OUT/pytest_gpu.txt | cut -c1-200 | tail -15
S=$(date +%s)
timeout 100 python3 experiments/mgpu/time_phase2.py --backward --base-only --wide > $OUT/time_phase2_bwd_wide.txt 2>&1; echo "phase2 bwd wide rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|relative|FAIL" $OUT/time_phase2_bwd_wide.txt | cut -c1-300
S=$(date +%s)
timeout 100 python3 experiments/mgpu/time_phase2.py --backward --base-only --chunks > $OUT/time_phase2_bwd_chunks.txt 2>&1; echo "phase2 bwd chunks rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|relative|FAIL" $OUT/time_phase2_bwd_chunks.txt | cut -c1-300
