#!/bin/bash
# Session 30, call 4: phase 1's one-stream backward kernels with a bf16 g_A now take 64-channel
# chunks (mosaic_gpu_bwd1.SINGLE_STREAM_BF16_GA). GPU tests of the one-stream reads, the main
# table's AttnRes and MHAR rows, and the AttnRes and MHAR `base` steps with and without the value
# channel (gpu_jobs/s30_no_channel.patch applied in a copy). Run from the repository root with
# carry [".whl", "gpu_jobs"].
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
NEW=$PWD
rm -rf /tmp/old && cp -r $NEW /tmp/old && (cd /tmp/old && patch -p1 < gpu_jobs/s30_no_channel.patch)
export PYTHONUNBUFFERED=1
run() { (cd $1 && PYTHONPATH=/tmp/site:$1:$1/experiments/mgpu "${@:2}"); }
run $NEW env JAX_PLATFORMS=cuda timeout 150 python -m pytest -q -m gpu tests/kernels/test_value_channel.py tests/kernels/test_mosaic_gpu_single_stream.py 2>&1 | tail -4 | tee $OUT/gpu_tests.txt
run $NEW timeout 150 python -m pallas_kernels.depth_attention.bench --backward pallas --configs attnres,mhar 2>&1 | grep -v Warning | tail -8 | tee $OUT/bench.txt
for cfg in attnres mhar; do
  for tree in $NEW /tmp/old; do
    run $tree timeout 100 python experiments/profile_step.py configs/$cfg.py:size=base --steps 2 --warmup 1 --top 12 --set model.residual.implementation=auto 2>&1 | grep -v Warning | tee $OUT/step_${cfg}_$(basename $tree).txt
  done
done
