#!/bin/bash
# Session 20, call 2: WGMMA-layout loads from a TMA-filled shared-memory window at row offsets 0..15, static and with a runtime 0 added (which source rows a wrong load returns); the expansion from one window per chunk (_Lags "single"), static and runtime offsets, against the aligned windows.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv > $OUT/nvidia_smi.txt 2>&1
S=$(date +%s)
timeout 100 python3 experiments/mgpu/offset_loads.py --runtime > $OUT/offset_loads.txt 2>&1; echo "offset_loads rc=$? $(( $(date +%s)-S ))s"; cut -c1-700 $OUT/offset_loads.txt | tail -6
S=$(date +%s)
timeout 150 python3 experiments/mgpu/expand_sources.py --single > $OUT/expand_sources.txt 2>&1; echo "expand_sources rc=$? $(( $(date +%s)-S ))s"; grep -v Warn $OUT/expand_sources.txt | cut -c1-400 | tail -6
