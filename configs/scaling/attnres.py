"""Scaling-law ladder (Figure 3, Appendix B): Block AttnRes on a scaled-down Table 4 backbone.

Sizes ladder_1 .. ladder_4 (configs/common.py) keep Table 4's depths and layers per block
(15/23/15/28 layers; S = 4/6/4/8, i.e. 8, 8, 8, 7 blocks) at ~8x smaller width, dense SwiGLU
at the activated FFN width; every mechanism at a rung gets the same backbone and token budget
(train.steps x batch_size x seq_len). size=scaling_1..scaling_4 gives the full Table 4
backbones (for accounting).

Usage: `--config=configs/scaling/attnres.py:size=ladder_2` (default ladder_1; smoke run: `:smoke=1`).
"""

from configs.common import make_config


def get_config(arg=None):
    return make_config("attnres", arg, default_size="ladder_1")
