#!/bin/bash
# Session 27, call 2: phase 2's Mosaic kernels with wider chunks (forward: MSAR 32/64, AttnRes
# 32/64/128; AttnRes's backward state pass 32/64/128), and the GPU tests of the scoring pass with
# its new default chunks. Run from the repository root.
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
JAX_PLATFORMS=cuda python -m pytest -q -m gpu -o addopts="" tests/kernels/test_mosaic_gpu_single_stream.py \
  tests/kernels/test_mosaic_gpu_phase1.py -k "scor or single_stream" 2>&1 | tail -15 | tee $OUT/gpu_tests.txt
python experiments/mgpu/time_phase2.py --chunks 2>&1 | grep -v Warning | tee $OUT/phase2_forward_chunks.txt
python experiments/mgpu/time_phase2.py --backward --chunks --attnres 2>&1 | grep -v Warning | tee $OUT/phase2_backward_attnres_chunks.txt
