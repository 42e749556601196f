#!/bin/bash
# Session 12, call 6: is the smoke MSAR training run bit-reproducible on the GPU (two straight runs)?
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
JAX_PLATFORMS=cuda timeout 100 python3 gpu_jobs/det.py 2>&1 | grep -v Warning | tail -3
