"""Block MSAR with m = 2 streams (Table 2 "m = 2"): the identity stream and one conv stream.

Kernel decision: the paper does not list the kernel sizes of its m = 2 / m = 8 rows. m = 2 keeps
the first (shortest) conv of the default bank, kernel sizes (4,), so the row removes streams
rather than changing the receptive field of the streams it keeps. S = 4 (10B ablations).

Usage: `--config=configs/ablations/m2.py:size=tiny` (smoke run: `:smoke=1`; keys: configs/common.py).
"""

from configs.common import make_config


def get_config(arg=None):
    return make_config("msar", arg, block_size=4, streams=2, kernel_sizes=(4,))
