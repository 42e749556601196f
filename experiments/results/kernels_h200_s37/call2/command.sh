#!/bin/bash
# Session 37 plan, call 2: session 34's cluster probe alone (clusters of 2-16 CTAs exchanging
# per-token sums through st.async; What remains 3). It printed nothing within 80 s in session 36:
# it compiles 12 variants first. Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
S=$(date +%s)
timeout 400 python experiments/mgpu/cluster_probe.py 2>&1 | grep -v Warning | tee $OUT/cluster_probe.txt
echo "probe $(( $(date +%s)-S ))s"
