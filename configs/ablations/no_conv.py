"""Block MSAR without the conv expansion: all m = 4 streams are the identity (Table 2 "w/o Conv").

The streams then differ only by their queries. Pinned to S = 4, the block size of the paper's
10B ablations (Table 2); the ``block_size=`` argument still overrides it.

Usage: `--config=configs/ablations/no_conv.py:size=tiny` (smoke run: `:smoke=1`; keys: configs/common.py).
"""

from configs.common import make_config


def get_config(arg=None):
    return make_config("msar", arg, block_size=4, conv=False)
