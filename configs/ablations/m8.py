"""Block MSAR with m = 8 streams (Table 2 "m = 8"): the identity stream and seven conv streams.

Kernel decision: the paper does not list the kernel sizes of its m = 2 / m = 8 rows. m = 8 uses
(2, 4, 6, 8, 10, 12, 16): it contains the default bank (4, 8, 12), fills the gaps with the even
sizes 2, 6, 10 and adds one longer window (16), so every default stream is still there and the
extra streams add both finer and wider token contexts. Conv parameters grow from 24 d to 58 d
per sublayer. S = 4 (10B ablations).

Usage: `--config=configs/ablations/m8.py:size=tiny` (smoke run: `:smoke=1`; keys: configs/common.py).
"""

from configs.common import make_config


def get_config(arg=None):
    return make_config("msar", arg, block_size=4, streams=8, kernel_sizes=(2, 4, 6, 8, 10, 12, 16))
