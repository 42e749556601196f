#!/bin/bash
# Session 20, call 5: windows="single" as every Mosaic kernel's placement (set in-process; Lane semantics): the base step profile, then phase 2's Mosaic GPU tests.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
SINGLE="import sys, runpy; from pallas_kernels.depth_attention import mosaic_gpu; mosaic_gpu.DEFAULT_WINDOWS = 'single'"
S=$(date +%s)
timeout 150 python3 -c "$SINGLE; sys.argv = ['experiments/profile_step.py', 'configs/msar.py:size=base', '--steps', '2', '--warmup', '1', '--top', '40', '--set', 'model.residual.implementation=auto']; runpy.run_path('experiments/profile_step.py', run_name='__main__')" > $OUT/profile_msar_single.txt 2>&1; echo "profile rc=$? $(( $(date +%s)-S ))s"; sed -n "4,6p;30,44p" $OUT/profile_msar_single.txt | cut -c1-150
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 150 python3 -c "$SINGLE; import pytest; sys.exit(pytest.main(['-v', '-p', 'no:cacheprovider', '-m', 'gpu', '-o', 'addopts=', 'tests/kernels/test_mosaic_gpu_phase2.py', 'tests/kernels/test_mosaic_gpu_phase1.py']))" > $OUT/gpu_tests_single.txt 2>&1; echo "gpu tests rc=$? $(( $(date +%s)-S ))s"; grep -E "PASS|FAIL|passed|failed|Error" $OUT/gpu_tests_single.txt | tail -10
