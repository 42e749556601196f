#!/bin/bash
# Session 36, call 3: the MSAR `base` step with the mix's windows per chunk and per item (dstreams
# per item in both), Vanilla's in the same call. Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
S=$(date +%s)
for fetch in per_chunk per_item; do
  timeout 165 python -c "
import sys; sys.path.insert(0, 'experiments')
from pallas_kernels.depth_attention import mosaic_gpu
mosaic_gpu.DEFAULT_MIX_WINDOW_FETCH = '$fetch'
import profile_step
profile_step.main(['configs/msar.py:size=base', '--steps', '2', '--warmup', '1', '--top', '12',
                   '--set', 'model.residual.implementation=auto'])" 2>&1 | grep -v Warning > $OUT/step_msar_mix_$fetch.txt
  echo "step msar mix $fetch $(( $(date +%s)-S ))s"; S=$(date +%s); head -8 $OUT/step_msar_mix_$fetch.txt
  grep -E "mix" $OUT/step_msar_mix_$fetch.txt
done
timeout 150 python experiments/profile_step.py configs/vanilla.py:size=base --steps 2 --warmup 1 --top 8 \
    --set model.residual.implementation=auto 2>&1 | grep -v Warning > $OUT/step_vanilla.txt
echo "vanilla $(( $(date +%s)-S ))s"; head -8 $OUT/step_vanilla.txt
