"""Block MSAR with S = 8 sublayers (four transformer layers) per block (Table 2 "S = 8").

Usage: `--config=configs/ablations/s8.py:size=tiny` (smoke run: `:smoke=1`; keys: configs/common.py).
At size=tiny (4 layers, L = 8) the whole stack is one block.
"""

from configs.common import make_config


def get_config(arg=None):
    return make_config("msar", arg, block_size=8)
