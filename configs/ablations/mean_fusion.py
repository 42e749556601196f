"""Block MSAR with the m = 4 streams averaged instead of gated (Table 2 "w/o H_pre").

Usage: `--config=configs/ablations/mean_fusion.py:size=tiny` (smoke run: `:smoke=1`; keys: configs/common.py).
S = 4 as in the paper's 10B ablations.
"""

from configs.common import make_config


def get_config(arg=None):
    return make_config("msar", arg, block_size=4, fusion="mean")
