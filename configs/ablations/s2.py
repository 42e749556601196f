"""Block MSAR with S = 2 sublayers (one transformer layer) per block (Table 2 "S = 2").

Usage: `--config=configs/ablations/s2.py:size=tiny` (smoke run: `:smoke=1`; keys: configs/common.py).
"""

from configs.common import make_config


def get_config(arg=None):
    return make_config("msar", arg, block_size=2)
