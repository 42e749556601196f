#!/bin/bash
# Session 21 (2026-12-03), call 7: ptxas's register and spill report for the Mosaic kernels at base (MOSAIC_GPU_DUMP_PTXAS; the input kernel and phase 2's two others).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
MOSAIC_GPU_DUMP_PTXAS=1 timeout 150 python3 experiments/mgpu/time_phase2.py --backward --base-only --inputs > $OUT/ptxas.txt 2>&1; echo "rc=$?"; grep -iE "registers|spill|bytes stack|Compiling entry|^##" $OUT/ptxas.txt | cut -c1-200 | head -40
