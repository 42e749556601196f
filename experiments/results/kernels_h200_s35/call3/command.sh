#!/bin/bash
# Session 35, call 3: the MSAR `base` step with today's defaults and with the mix's and dstreams'
# windows brought once per chunk (whole profile header: the median step time; the kernels'
# lines), Vanilla's in the same call, then experiments/mgpu/cluster_probe.py (clusters of 2-16
# CTAs sharing per-token sums through st.async: What remains 3). Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
S=$(date +%s)
for fetch in per_item per_chunk; do
  timeout 170 python -c "
import sys; sys.path.insert(0, 'experiments')
from pallas_kernels.depth_attention import mosaic_gpu, mosaic_gpu_bwd1
mosaic_gpu.DEFAULT_MIX_WINDOW_FETCH = '$fetch'
mosaic_gpu_bwd1.DEFAULT_DSTREAMS_WINDOW_FETCH = '$fetch'
import profile_step
profile_step.main(['configs/msar.py:size=base', '--steps', '2', '--warmup', '1', '--top', '12',
                   '--set', 'model.residual.implementation=auto'])" 2>&1 | grep -v Warning > $OUT/step_msar_$fetch.txt
  echo "step msar $fetch $(( $(date +%s)-S ))s"; S=$(date +%s); head -8 $OUT/step_msar_$fetch.txt
  grep -E "mix|dstreams" $OUT/step_msar_$fetch.txt
done
timeout 150 python experiments/profile_step.py configs/vanilla.py:size=base --steps 2 --warmup 1 --top 8 \
    --set model.residual.implementation=auto 2>&1 | grep -v Warning > $OUT/step_vanilla.txt
echo "step vanilla $(( $(date +%s)-S ))s"; S=$(date +%s); head -8 $OUT/step_vanilla.txt
timeout 90 python experiments/mgpu/cluster_probe.py 2>&1 | grep -v Warning | tee $OUT/cluster_probe.txt
echo "probe $(( $(date +%s)-S ))s"
