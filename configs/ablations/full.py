"""Full MSAR, S = 1: every sublayer output is its own source (Table 2 "Full").

Usage: `--config=configs/ablations/full.py:size=tiny` (smoke run: `:smoke=1`; keys: configs/common.py).
"""

from configs.common import make_config


def get_config(arg=None):
    return make_config("msar", arg, block_size=1)
