"""``python -m msar_jax.train --config=configs/msar.py:size=tiny --workdir=DIR`` (see train.py)."""

from msar_jax.train.train import main

if __name__ == "__main__":
    main()
