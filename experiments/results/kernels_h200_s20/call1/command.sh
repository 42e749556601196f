#!/bin/bash
# Session 20, call 1: the expansion with one window per chunk and each lag's tile a 0/1 shift matrix times it on the tensor cores (tma_wgmma, 32 and 64 channels) against the aligned TMA windows.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv > $OUT/nvidia_smi.txt 2>&1
S=$(date +%s)
timeout 150 python3 experiments/mgpu/expand_sources.py --wgmma > $OUT/expand_sources.txt 2>&1; echo "expand_sources rc=$? $(( $(date +%s)-S ))s"; cut -c1-600 $OUT/expand_sources.txt | tail -12
