#!/bin/bash
# Session 21 (2026-12-03), call 10: the base step with the input kernel on two warpgroups (mosaic_gpu.INPUTS_WARPGROUPS = 2, the new default).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
timeout 200 python3 experiments/profile_step.py configs/msar.py:size=base --steps 2 --warmup 1 --top 40 --set model.residual.implementation=auto > $OUT/profile_msar_wg2.txt 2>&1; echo "profile rc=$? $(( $(date +%s)-S ))s"; sed -n "4,6p;30,42p" $OUT/profile_msar_wg2.txt | cut -c1-150
