#!/bin/bash
# Session 33, call 3: MHAR's `base` step with the query gradient's products per head
# ("batched", today's default) and over all heads ("all_heads"; call 1: phase 1's forward +
# backward 3.418 -> 3.356 ms per block at the shape, temporaries 0.602 -> 0.039 GiB).
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
for f in batched all_heads; do
  timeout 200 python -c "
import sys; sys.path.insert(0, 'experiments')
from pallas_kernels.depth_attention import fused_bwd_phase1
fused_bwd_phase1.DEFAULT_QUERY_GRADS_HEADS = '$f'
import profile_step
profile_step.main(['configs/mhar.py:size=base', '--steps', '2', '--warmup', '1', '--top', '8',
                   '--set', 'model.residual.implementation=auto'])" 2>&1 | grep -v Warning | tee $OUT/step_mhar_$f.txt | tail -30
done
