#!/bin/bash
# Planned in session 33 (no device): MSAR per sublayer and the MSAR `base` step with today's
# defaults (divide, extf) and with both untimed options (carried, bits). Repository root, carry
# [".whl"]; ~9 minutes. Add the AttnRes step (configs/attnres.py) if time is left.
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
run() {  # run <decode> <upcast> <python code>
  timeout 160 python -c "
import sys; sys.path.insert(0, 'experiments')
from pallas_kernels.depth_attention import mosaic_gpu, mosaic_gpu_bwd1
mosaic_gpu.DEFAULT_MIX_ITEM_DECODE = mosaic_gpu_bwd1.DEFAULT_ITEM_DECODE = '$1'
mosaic_gpu.DEFAULT_UPCAST = '$2'
$3" 2>&1 | grep -v Warning
}
for v in "divide extf" "carried bits"; do
  set -- $v
  run $1 $2 "
from pallas_kernels.depth_attention import bench
sys.argv = ['bench', '--backward', 'pallas', '--configs', 'msar']
bench.main()" | tail -4 | tee $OUT/bench_msar_$1_$2.txt
  run $1 $2 "
import profile_step
profile_step.main(['configs/msar.py:size=base', '--steps', '2', '--warmup', '1', '--top', '8',
                   '--set', 'model.residual.implementation=auto'])" | tee $OUT/step_msar_$1_$2.txt
done
