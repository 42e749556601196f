"""Two straight smoke MSAR runs on the GPU, in one process: are the losses bit-reproducible?"""
import sys, tempfile, numpy as np
sys.path.insert(0, "tests")
from msar_jax.configs import load_config
from msar_jax.train import train
base = {"train.steps": 20, "checkpoint.every": 5, "train.eval_every": 0, "train.eval_batches": 1,
        "train.progress": False, "train.tensorboard": False, "train.depth_weights": False}
cfg = load_config("configs/msar.py:smoke=1", base)
d = tempfile.mkdtemp()
a = np.array(train(cfg, d + "/a", handle_signals=False)["losses"])[:, 1]
b = np.array(train(cfg, d + "/b", handle_signals=False)["losses"])[:, 1]
print("straight twice: max abs diff", float(np.max(np.abs(a - b))), "first differing step", int(np.argmax(a != b)) + 1 if (a != b).any() else None)
