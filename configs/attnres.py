"""Block AttnRes (Table 2 row 3; block_size=1 is Full AttnRes).

Usage: `--config=configs/attnres.py:size=tiny` (sizes and argument keys: configs/common.py).
"""

from configs.common import make_config


def get_config(arg=None):
    return make_config("attnres", arg)
