"""Standard residual baseline (Table 2 row 1).

Usage: `--config=configs/vanilla.py:size=tiny` (sizes and argument keys: configs/common.py).
"""

from configs.common import make_config


def get_config(arg=None):
    return make_config("vanilla", arg)
