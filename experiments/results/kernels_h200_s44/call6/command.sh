#!/bin/bash
# Session 44, call 6: call 5 again with today's default windows ("padded"; call 5's --gate-stats
# form still took session 19's "aligned"): phase 2's forward with each mosaic_gpu.GATE_STATS, timed
# at both shapes, then the per-sublayer bench at the issue's shape with "in_scores" as the default
# (the bench with "own_pass" is call 1's). Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
S=$(date +%s)
timeout 150 python experiments/mgpu/time_phase2.py --gate-stats --msar-only 2>&1 | grep -v Warning | tee $OUT/gate_stats.txt
echo "timing $(( $(date +%s)-S ))s"
timeout 220 python - <<'PY' 2>&1 | grep -v Warning | tail -8 > $OUT/bench_msar_in_scores.txt
import runpy, sys
from pallas_kernels.depth_attention import mosaic_gpu
mosaic_gpu.DEFAULT_GATE_STATS = "in_scores"
sys.argv = ["bench", "--backward", "pallas", "--configs", "msar"]
runpy.run_module("pallas_kernels.depth_attention.bench", run_name="__main__", alter_sys=True)
PY
grep -E "copy bandwidth|fwd:|fb:" $OUT/bench_msar_in_scores.txt
echo "bench $(( $(date +%s)-S ))s"
