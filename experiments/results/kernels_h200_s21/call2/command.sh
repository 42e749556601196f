#!/bin/bash
# Session 21 (2026-12-03), call 2: 32- against 64-channel chunks with the padded windows in phase 2's forward and phase 1's scoring and mixing passes, at base.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
timeout 80 python3 experiments/mgpu/time_phase2.py --base-only --msar-only --chunks > $OUT/time_phase2_fwd_chunks.txt 2>&1; echo "phase2 fwd rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|ms |FAIL" $OUT/time_phase2_fwd_chunks.txt | cut -c1-200
S=$(date +%s)
timeout 60 python3 experiments/mgpu/time_phase1_scores.py --base-only --chunks > $OUT/time_phase1_scores_chunks.txt 2>&1; echo "phase1 scores rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|ms |FAIL" $OUT/time_phase1_scores_chunks.txt | cut -c1-200
S=$(date +%s)
timeout 80 python3 experiments/mgpu/time_phase1_mix.py --base-only --chunks > $OUT/time_phase1_mix_chunks.txt 2>&1; echo "phase1 mix rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|ms |FAIL|bytes" $OUT/time_phase1_mix_chunks.txt | cut -c1-200
