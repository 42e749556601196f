#!/bin/bash
# Session 19, call 5: call 4's second step again after fixing the script (a name clash in time_phase1_mix.py --bf16-aligned): phase 1's mixing pass with a bf16 state and the aligned windows against Triton.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv > $OUT/nvidia_smi.txt 2>&1
S=$(date +%s)
timeout 110 python3 experiments/mgpu/time_phase1_mix.py --bf16-aligned --base-only > $OUT/time_phase1_mix.txt 2>&1; echo "time_phase1_mix rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|ms |fit|FAIL|Error" $OUT/time_phase1_mix.txt | cut -c1-200
