#!/bin/bash
# session 38, call 4: the probe with exactly representable sums, push and pull, G = 2, 8, 16
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
for args in "pull --only 2" "pull --only 8" "pull --only 16" "pull --only 8 --no-fence" "push --only 2" "push --only 8" "push --only 16"; do
  timeout 25 python experiments/mgpu/cluster_probe.py --mode $args 2>&1 | grep -v "Warning\|cuda_\|Source Loc\|^$\|got = sum" | tail -3 | tee -a $OUT/cluster_probe_exact.txt
done
