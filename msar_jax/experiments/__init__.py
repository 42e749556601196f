"""Experiments of the MSAR paper, one command each.

* ``python -m msar_jax.experiments.ablation --size=small --seeds=3 --workdir=W`` - Table 2: every
  ablation row, paired by seed, skip-finished / resume, ``results.json`` + ``table.md`` + PNGs.
* ``python -m msar_jax.experiments.scaling --workdir=W [--train]`` - Eq. 18 / Appendix B scaling
  law over the four-rung ladder (configs/scaling/), iso-loss speedups, loss-vs-compute PNG.
* ``python -m msar_jax.experiments.tables`` - Tables 5 and 6 from ``msar_jax.accounting`` beside
  the paper's values.
* ``python -m msar_jax.experiments.plots`` - Figure 5 (structured depth-mixing matrices, L=4, S=2)
  and the training-curve / Figure 4 plots of an existing ablation workdir.

Results and the exact commands: ``results/RESULTS.md``.
"""
