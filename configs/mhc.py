"""mHC, m = 4 residual streams, 20 Sinkhorn-Knopp iterations (Table 2 row 2).

Usage: `--config=configs/mhc.py:size=tiny` (sizes and argument keys: configs/common.py).
"""

from configs.common import make_config


def get_config(arg=None):
    return make_config("mhc", arg)
