#!/bin/bash
# Session 29, call 5: phase 1's backward kernels gdots and dstreams (Mosaic GPU) for one stream
# (AttnRes) with 16-, 32- and 64-channel chunks and several slot counts, at `base`'s last block and
# the shape, against Triton's. Run from the repository root with carry [".whl"].
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
python experiments/mgpu/time_phase1_bwd.py --attnres 2>&1 | grep -v Warning | tee $OUT/time_phase1_bwd_attnres.txt
