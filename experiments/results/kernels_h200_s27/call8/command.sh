#!/bin/bash
# Session 27, call 8: one stream's phase-2 output pass on its own 16 x 128 Triton tile
# (Tiles.mix_tiles): the GPU test of "auto" for one stream, the AttnRes and Vanilla `base`
# steps, AttnRes per sublayer. Run from the repository root.
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
JAX_PLATFORMS=cuda python -m pytest -q -m gpu -o addopts="" tests/kernels/test_mosaic_gpu_single_stream.py \
  -k auto_matches 2>&1 | tail -15 | tee $OUT/gpu_tests.txt
for c in attnres vanilla; do
  python experiments/profile_step.py configs/$c.py:size=base --steps 2 --warmup 1 --top 30 \
    --set model.residual.implementation=auto 2>&1 | grep -v Warning | tee $OUT/profile_$c.txt
done
python -m pallas_kernels.depth_attention.bench --backward pallas --configs attnres 2>&1 | grep -v Warning | tail -6 | tee $OUT/bench_attnres.txt
