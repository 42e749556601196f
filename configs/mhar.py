"""MHAR: AttnRes with H = 8 channel heads (the MHAR paper; docs/design.md §8).

Usage: `--config=configs/mhar.py:size=tiny` (sizes and argument keys: configs/common.py).
"""

from configs.common import make_config


def get_config(arg=None):
    return make_config("mhar", arg)
