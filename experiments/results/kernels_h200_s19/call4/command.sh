#!/bin/bash
# Session 19, call 4: the expansion's fetch alone (tma_fetch: the same TMA windows, no conv) against the full expansion, to split the copies' time from the loads' and arithmetic's; phase 1's mixing pass with a bf16 state and the aligned windows against Triton (session 18 timed it only with per-lag windows).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv > $OUT/nvidia_smi.txt 2>&1
S=$(date +%s)
timeout 100 python3 experiments/mgpu/expand_sources.py > $OUT/expand_sources.txt 2>&1; echo "expand_sources rc=$? $(( $(date +%s)-S ))s"; cut -c1-300 $OUT/expand_sources.txt | tail -8
S=$(date +%s)
timeout 100 python3 experiments/mgpu/time_phase1_mix.py --bf16-aligned --base-only > $OUT/time_phase1_mix.txt 2>&1; echo "time_phase1_mix rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|ms |fit|FAIL" $OUT/time_phase1_mix.txt | cut -c1-200
