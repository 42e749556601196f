#!/bin/bash
# Session 20, call 3: where each element of a wrong WGMMA-layout shared-memory load at row offsets 1..7 comes from (offset_loads.py --map); the expansion from one window per chunk (_Lags "single", the whole window fetched from an aligned shared-memory row), timed although its loads at odd offsets are wrong.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
timeout 100 python3 experiments/mgpu/offset_loads.py --map > $OUT/offset_map.txt 2>&1; echo "offset_map rc=$? $(( $(date +%s)-S ))s"; grep -A4 "offset [12]:" $OUT/offset_map.txt | cut -c1-200
S=$(date +%s)
timeout 150 python3 experiments/mgpu/expand_sources.py --single > $OUT/expand_sources.txt 2>&1; echo "expand_sources rc=$? $(( $(date +%s)-S ))s"; grep -v Warn $OUT/expand_sources.txt | cut -c1-400 | tail -6
