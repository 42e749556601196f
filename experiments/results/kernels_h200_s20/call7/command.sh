#!/bin/bash
# Session 20 (2026-12-03), call 7: the one-window expansion with 64-byte against 80-byte (padded) rows (bank conflicts?); phase 1's mixing pass with one window per chunk and 2, 3, 4 slots (2 fit three programs per SM).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
timeout 60 python3 experiments/mgpu/expand_sources.py --single-pad --lane > $OUT/expand_sources_pad.txt 2>&1; echo "expand_sources rc=$? $(( $(date +%s)-S ))s"; grep -E "expansion|exact|WRONG" $OUT/expand_sources_pad.txt | cut -c1-200
S=$(date +%s)
timeout 120 python3 experiments/mgpu/time_phase1_mix.py --base-only --single-slots > $OUT/time_phase1_mix.txt 2>&1; echo "phase1 mix rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|ms |fit|FAIL" $OUT/time_phase1_mix.txt | cut -c1-200
