#!/bin/bash
# Session 38 plan, call 2 (only if call 1's pull exchange is exact): the MSAR `base` step with phase
# 2's forward on clusters (`_backend.AUTO_CLUSTER_FORWARD`, pull, two warpgroups; `PROGRAMS`: None
# or "walking", call 1's faster), the step without them and Vanilla's, all in this call. Carry [".whl"].
PROGRAMS=${PROGRAMS:-None}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
S=$(date +%s)
for cluster in True False; do
  timeout 170 python -c "
import sys; sys.path.insert(0, 'experiments')
from pallas_kernels.depth_attention import _backend
_backend.AUTO_CLUSTER_FORWARD = $cluster
_backend.CLUSTER_PROGRAMS = $PROGRAMS
import profile_step
profile_step.main(['configs/msar.py:size=base', '--steps', '2', '--warmup', '1', '--top', '12',
                   '--set', 'model.residual.implementation=auto'])" 2>&1 | grep -v Warning > $OUT/step_msar_cluster_$cluster.txt
  echo "step msar cluster=$cluster $(( $(date +%s)-S ))s"; S=$(date +%s); head -8 $OUT/step_msar_cluster_$cluster.txt
  grep -iE "cluster|phase2|fused" $OUT/step_msar_cluster_$cluster.txt | head -6
done
timeout 150 python experiments/profile_step.py configs/vanilla.py:size=base --steps 2 --warmup 1 --top 8 \
    --set model.residual.implementation=auto 2>&1 | grep -v Warning > $OUT/step_vanilla.txt
echo "vanilla $(( $(date +%s)-S ))s"; head -8 $OUT/step_vanilla.txt
