#!/bin/bash
# Session 37, call 1b (call 1 and call 2 merged after three failed starts this session cost
# device time): the mix's --fetch-bound variants, then session 34's cluster probe (What
# remains 3). The bench rows of call 1 wait for a later call. Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
S=$(date +%s)
timeout 250 python experiments/mgpu/time_phase1_mix.py --fetch-bound 2>&1 | grep -v Warning | tee $OUT/fetch_bound.txt
echo "fetch-bound $(( $(date +%s)-S ))s"; S=$(date +%s)
timeout 300 python experiments/mgpu/cluster_probe.py 2>&1 | grep -v Warning | tee $OUT/cluster_probe.txt
echo "probe $(( $(date +%s)-S ))s"
