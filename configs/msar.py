"""Block MSAR, m = 4 streams with kernels (4, 8, 12) and the H_pre gate (Table 2 row 5).

Usage: `--config=configs/msar.py:size=tiny` (sizes and argument keys: configs/common.py).
"""

from configs.common import make_config


def get_config(arg=None):
    return make_config("msar", arg)
