#!/bin/bash
# Session 20 (2026-12-03), call 8: the one window with rows padded to 80 bytes ("padded") in every Mosaic kernel, timed against each kernel's current placement at base; the base step with "padded" in all four kernels (set in-process).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
timeout 70 python3 experiments/mgpu/time_phase2.py --base-only --msar-only --padded > $OUT/time_phase2_fwd.txt 2>&1; echo "phase2 fwd rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|ms |FAIL" $OUT/time_phase2_fwd.txt | cut -c1-200
S=$(date +%s)
timeout 50 python3 experiments/mgpu/time_phase1_scores.py --base-only --padded > $OUT/time_phase1_scores.txt 2>&1; echo "phase1 scores rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|ms |FAIL" $OUT/time_phase1_scores.txt | cut -c1-200
S=$(date +%s)
timeout 60 python3 experiments/mgpu/time_phase1_mix.py --base-only --padded > $OUT/time_phase1_mix.txt 2>&1; echo "phase1 mix rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|ms |FAIL" $OUT/time_phase1_mix.txt | cut -c1-200
S=$(date +%s)
timeout 70 python3 experiments/mgpu/time_phase2.py --backward --base-only --padded > $OUT/time_phase2_bwd.txt 2>&1; echo "phase2 bwd rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|relative|FAIL" $OUT/time_phase2_bwd.txt | cut -c1-300
PADDED="import sys, runpy; from pallas_kernels.depth_attention import mosaic_gpu; mosaic_gpu.DEFAULT_WINDOWS = 'padded'"
S=$(date +%s)
timeout 130 python3 -c "$PADDED; sys.argv = ['experiments/profile_step.py', 'configs/msar.py:size=base', '--steps', '2', '--warmup', '1', '--top', '40', '--set', 'model.residual.implementation=auto']; runpy.run_path('experiments/profile_step.py', run_name='__main__')" > $OUT/profile_msar_padded.txt 2>&1; echo "profile rc=$? $(( $(date +%s)-S ))s"; sed -n "4,6p;30,40p" $OUT/profile_msar_padded.txt | cut -c1-150
