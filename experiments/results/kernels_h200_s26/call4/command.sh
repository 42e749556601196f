#!/bin/bash
# Session 26, call 4: MHAR's base step with "auto" taking phase 1's scoring pass, gdots and dstreams in Mosaic for its 8 heads.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
timeout 130 python3 experiments/profile_step.py configs/mhar.py:size=base --steps 2 --warmup 1 --top 20 --set model.residual.implementation=auto > $OUT/profile_mhar.txt 2>&1; echo "profile mhar rc=$? $(( $(date +%s)-S ))s"; sed -n "4,6p" $OUT/profile_mhar.txt | cut -c1-160; grep -E "depth_" $OUT/profile_mhar.txt | head -20 | cut -c1-160
