#!/bin/bash
# Session 21, call 3: phase 1 mixing pass with the padded windows and a bf16 state (untimed since session 20).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 100 python3 experiments/mgpu/time_phase1_mix.py --base-only --bf16 --padded > $OUT/time_phase1_mix_bf16.txt 2>&1; echo "mix rc=$?"; grep -E "^##|ms |FAIL|bytes" $OUT/time_phase1_mix_bf16.txt | cut -c1-200
