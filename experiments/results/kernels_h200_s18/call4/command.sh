#!/bin/bash
# Session 18, call 4: lag windows placed one per lag modulo 8 (windows="aligned": 8 TMA copies instead of 12, loads at multiples of 8 rows) in all four Mosaic kernels: the base step with it (and the mixing pass with 3 slots, which it lets fit), then the mixing, scoring and phase-2 forward passes against per_lag.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
timeout 150 python3 -c "
import runpy, sys
from pallas_kernels.depth_attention import mosaic_gpu
mosaic_gpu.DEFAULT_WINDOWS = 'aligned'; mosaic_gpu.MIX_SLOTS = 3
sys.argv = ['experiments/profile_step.py', 'configs/msar.py:size=base', '--steps', '2', '--warmup', '1', '--top', '40', '--set', 'model.residual.implementation=auto']
runpy.run_path('experiments/profile_step.py', run_name='__main__')
" > $OUT/profile_msar_aligned_mix3.txt 2>&1; echo "profile rc=$? $(( $(date +%s)-S ))s"; sed -n "4,6p;30,46p" $OUT/profile_msar_aligned_mix3.txt | cut -c1-150
S=$(date +%s)
timeout 75 python3 experiments/mgpu/time_phase1_mix.py --base-only > $OUT/time_phase1_mix.txt 2>&1; echo "time_phase1_mix rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|ms |fit" $OUT/time_phase1_mix.txt | cut -c1-200
S=$(date +%s)
timeout 55 python3 experiments/mgpu/time_phase1_scores.py --base-only > $OUT/time_phase1_scores.txt 2>&1; echo "time_phase1_scores rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|ms " $OUT/time_phase1_scores.txt | cut -c1-200
S=$(date +%s)
timeout 60 python3 experiments/mgpu/time_phase2.py --base-only --msar-only > $OUT/time_phase2.txt 2>&1; echo "time_phase2 rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|ms " $OUT/time_phase2.txt | cut -c1-200
