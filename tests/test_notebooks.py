"""The notebooks (notebooks/*.ipynb) run top to bottom at tiny size; a failing cell fails the test.

Each notebook is executed with nbclient in a fresh kernel (the test's Python), in ``notebooks/``,
with its parameter cell shrunk through ``MSAR_NOTEBOOK_*`` environment variables. The runs of all
three share one temporary folder: the MSAR checkpoint that ``quickstart`` trains is the one
``msar_explorer`` (real-activation section) and ``depth_patterns`` load; run alone, each of those
trains its own tiny one first. The stored notebooks must have no outputs.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
NAMES = ("quickstart", "msar_explorer", "depth_patterns")

TINY = {
    "MSAR_NOTEBOOK_STEPS": "8",
    "MSAR_NOTEBOOK_BATCH": "4",
    "MSAR_NOTEBOOK_SEQ_LEN": "32",
    "MSAR_NOTEBOOK_FAST_COMPILE": "1",
    "MSAR_NOTEBOOK_REAL": "1",
}


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("notebook_runs")


def _run(name: str, env: dict) -> None:
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    old = dict(os.environ)
    # The kernel inherits the environment: one host CPU device (not the suite's 8 fake ones).
    os.environ["XLA_FLAGS"] = os.environ.get("MSAR_TEST_XLA_FLAGS", "")
    os.environ.update(env)
    try:
        client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                         resources={"metadata": {"path": str(NOTEBOOKS)}})
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(old)


@pytest.mark.parametrize("name", NAMES)
def test_notebook_stored_without_outputs(name):
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{name}: strip the outputs"


@pytest.mark.parametrize("name", NAMES)  # in this order: quickstart trains the shared checkpoint
def test_notebook_runs(name, runs_dir):
    env = dict(TINY, MSAR_NOTEBOOK_RUNS=str(runs_dir), MSAR_NOTEBOOK_SEARCH=str(runs_dir), JAX_PLATFORMS="cpu")
    _run(name, env)


@pytest.mark.parametrize("arg", ["smoke=1,block_size=1", "smoke=1,conv=0,fusion=mean"])
def test_capture_reproduces_the_model(arg):
    """``explorer.capture`` (which the explorer and depth-patterns notebooks use) reproduces the
    model's logits, every read's ``h`` through ``msar_read`` and the introspection weights, also
    for Full MSAR and the no-conv / mean-fusion ablations the notebooks do not run."""
    import jax
    import numpy as np

    from msar_jax import explorer
    from msar_jax.configs import load_config
    from msar_jax.train.step import init_model

    cfg = load_config(f"configs/msar.py:{arg}")
    model_def, params = init_model(cfg.model, 0)
    leaves, tree = jax.tree.flatten(params)  # queries, banks start at zero: perturb everything
    key = jax.random.PRNGKey(1)
    params = jax.tree.unflatten(tree, [x + 0.3 * jax.random.normal(jax.random.fold_in(key, i), x.shape)
                                       for i, x in enumerate(leaves)])
    tokens = jax.random.randint(key, (2, 12), 0, 256)
    cap = explorer.capture(model_def, params, tokens, cfg)
    logits, aux = jax.jit(lambda p, t: model_def.merge(p)(t, collect_weights=True))(params, tokens)
    np.testing.assert_allclose(cap.logits, np.asarray(logits), atol=1e-4)
    np.testing.assert_allclose(explorer.capture_depth_weights(cap), np.asarray(aux["depth_weights"]), atol=1e-5)
    scene = explorer.CapturedScene(cap, batch_row=1)
    for target in scene.targets:
        for stream in range(len(scene.stream_names)):
            e = explorer.explain(scene.read(target), stream, 7)  # asserts h, z and expand agree
            assert abs(e.weights.sum() - 1.0) < 1e-5
    assert (explorer.gate_values(cap) is None) == ("fusion=mean" in arg)
