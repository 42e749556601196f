#!/bin/bash
# Session 36, call 4: the main table's MSAR row at the shape with the mix's windows per
# chunk (today's default since 062e598). Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
timeout 430 python -c "
import sys, runpy
from pallas_kernels.depth_attention import mosaic_gpu
mosaic_gpu.DEFAULT_MIX_WINDOW_FETCH = 'per_chunk'
sys.argv = ['bench', '--backward', 'pallas', '--configs', 'msar']
runpy.run_module('pallas_kernels.depth_attention.bench', run_name='__main__')" 2>&1 | grep -v Warning | tail -8 \
    | tee $OUT/bench_msar_mix_per_chunk.txt
cp bench_log.jsonl $OUT/ 2>/dev/null; echo "bench $(( $(date +%s)-S ))s"
