"""AttnRes + mHC hybrid, m = 4, S = 4 (Table 2 row 4).

Usage: `--config=configs/attnres_mhc.py:size=tiny` (sizes and argument keys: configs/common.py).
"""

from configs.common import make_config


def get_config(arg=None):
    return make_config("attnres_mhc", arg)
