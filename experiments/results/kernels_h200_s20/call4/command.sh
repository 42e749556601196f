#!/bin/bash
# Session 20, call 4: the one-window expansion in Lane semantics (exact? timed); then the four Mosaic kernels with windows="single" (Lane semantics; tile buffers swizzled, and plain) against "aligned" at base: phase 2 forward, phase 1 scores, phase 1 mix, phase 2 backward (passes 1-2).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
timeout 40 python3 experiments/mgpu/expand_sources.py --single --lane > $OUT/expand_sources_lane.txt 2>&1; echo "expand_sources rc=$? $(( $(date +%s)-S ))s"; grep -v Warn $OUT/expand_sources_lane.txt | cut -c1-200 | tail -3
S=$(date +%s)
timeout 90 python3 experiments/mgpu/time_phase2.py --base-only --msar-only --single > $OUT/time_phase2_fwd.txt 2>&1; echo "phase2 fwd rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|ms |FAIL" $OUT/time_phase2_fwd.txt | cut -c1-200
S=$(date +%s)
timeout 60 python3 experiments/mgpu/time_phase1_scores.py --base-only --single > $OUT/time_phase1_scores.txt 2>&1; echo "phase1 scores rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|ms |FAIL" $OUT/time_phase1_scores.txt | cut -c1-200
S=$(date +%s)
timeout 90 python3 experiments/mgpu/time_phase1_mix.py --base-only --single > $OUT/time_phase1_mix.txt 2>&1; echo "phase1 mix rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|ms |fit|FAIL" $OUT/time_phase1_mix.txt | cut -c1-200
S=$(date +%s)
timeout 100 python3 experiments/mgpu/time_phase2.py --backward --base-only --single > $OUT/time_phase2_bwd.txt 2>&1; echo "phase2 bwd rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|relative|FAIL" $OUT/time_phase2_bwd.txt | cut -c1-300
