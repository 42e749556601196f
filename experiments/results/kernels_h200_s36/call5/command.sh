#!/bin/bash
# Session 36, call 5: MSAR per sublayer with the bf16 state option (state_dtype="bfloat16", not
# SPEC 5's default) and the mix's windows per chunk; then session 34's cluster probe (it printed
# nothing within its 80 s). Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
S=$(date +%s)
timeout 250 python -c "
import sys, runpy
from pallas_kernels.depth_attention import mosaic_gpu
mosaic_gpu.DEFAULT_MIX_WINDOW_FETCH = 'per_chunk'
sys.argv = ['bench', '--backward', 'pallas', '--configs', 'msar', '--state_dtype', 'bfloat16']
runpy.run_module('pallas_kernels.depth_attention.bench', run_name='__main__')" 2>&1 | grep -v Warning | tail -6 \
    | tee $OUT/bench_msar_bf16_state.txt
echo "bench $(( $(date +%s)-S ))s"; S=$(date +%s)
timeout 80 python experiments/mgpu/cluster_probe.py 2>&1 | grep -v Warning | tee $OUT/cluster_probe.txt
echo "probe $(( $(date +%s)-S ))s"
