"""The notebooks (notebooks/*.ipynb): they run top to bottom at tiny size, their stored outputs
belong to their current cells, and their install cell finds the package or says what to do.

Execution goes through ``tools/execute_notebooks.py`` (what ``make notebooks`` runs, without
writing): each notebook in a fresh kernel (the test's Python), in ``notebooks/``, its parameter cell
shrunk through ``MSAR_NOTEBOOK_*`` environment variables, all three sharing one temporary runs
folder (the MSAR checkpoint that ``quickstart`` trains is the one the other two load). A failing
cell fails the test; the stored notebooks are not touched.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"
_spec = importlib.util.spec_from_file_location("execute_notebooks", REPO / "tools" / "execute_notebooks.py")
execute_notebooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(execute_notebooks)
NAMES = execute_notebooks.NAMES

# Any absolute path of the machine that stored the outputs (they are rewritten to <repo> / <runs>).
MACHINE_PATH = re.compile(r"(?<![\w.<>~])/(?:tmp|work|home|root|Users|private|var|opt|content)/|[A-Z]:\\\\")


def _stored(name: str):
    return nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)


def _images(cell) -> int:
    return sum("image/png" in out.get("data", {}) for out in cell.outputs)


def _install_cell(name: str) -> str:
    cell = _stored(name).cells[1]
    assert cell.cell_type == "code" and cell.source.startswith("# Install msar_jax"), f"{name}: cell 1 installs"
    return cell.source


@pytest.mark.parametrize("name", NAMES)
def test_notebook_stored_with_current_outputs(name):
    """What a code host shows: every code cell ran once, in order, without error, for the cells as
    they are now (the hash ``make notebooks`` records), with figures, and nothing machine-specific."""
    nb = _stored(name)
    nbformat.validate(nb)
    meta = nb.metadata.get(execute_notebooks.HASH_KEY, {})
    assert meta.get("executed_code_sha256") == execute_notebooks.code_hash(nb), (
        f"{name}: the stored outputs are not from the current cells; run `make notebooks`")
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), f"{name}: run top to bottom once"
    assert all(out.output_type != "error" for c in code for out in c.outputs)
    assert all(c.outputs for c in code), f"{name}: a code cell without output"
    assert sum(_images(c) for c in code) >= 1, f"{name}: figures are stored"
    assert "widgets" not in nb.metadata
    text = json.dumps([c.outputs for c in code])
    assert execute_notebooks.WIDGET_MIME not in text and "IProgress not found" not in text
    assert not MACHINE_PATH.search(text), f"{name}: machine path {MACHINE_PATH.search(text).group()!r} in outputs"
    assert "\\r" not in text, f"{name}: progress bars are stored as their final line"


def test_notebooks_folder_stays_small():
    sizes = {p.name: p.stat().st_size for p in NOTEBOOKS.iterdir() if p.is_file()}
    assert sum(sizes.values()) < 2_000_000, sizes  # figures at 80 dpi: about 1 MB for all three


@pytest.mark.parametrize("name", NAMES)  # in this order: quickstart trains the shared checkpoint
def test_notebook_runs(name, tmp_path_factory):
    runs_dir = tmp_path_factory.getbasetemp() / "notebook_runs"
    runs_dir.mkdir(exist_ok=True)
    nb = execute_notebooks.execute(name, runs_dir, xla_flags=os.environ.get("MSAR_TEST_XLA_FLAGS", ""))
    stored = _stored(name)
    # The run draws the figures the stored notebook shows, cell by cell.
    assert [_images(c) for c in nb.cells if c.cell_type == "code"] == \
        [_images(c) for c in stored.cells if c.cell_type == "code"]
    assert "msar_jax from ../msar_jax" in "".join(o.get("text", "") for o in nb.cells[1].outputs)  # the checkout


def test_install_cells_are_one_cell():
    """The package source is set in one cell's text, the same in every notebook."""
    first = _install_cell(NAMES[0])
    assert all(_install_cell(name) == first for name in NAMES[1:])
    assert re.search(r'^MSAR_JAX_REPO = ""', first, re.M)


def _run_install_cell(cwd: Path, env: dict | None = None, installed: bool = False) -> subprocess.CompletedProcess:
    """The install cell as a plain script in ``cwd``, printing its error as IPython would. Unless
    ``installed``, ``import msar_jax`` fails there (a package of that name raising ImportError
    shadows the installed one), as in a fresh Colab runtime."""
    shadow = cwd.parent / "shadow"
    (shadow / "msar_jax").mkdir(parents=True, exist_ok=True)
    (shadow / "msar_jax" / "__init__.py").write_text("raise ImportError('not installed')\n")
    script = ("import sys\ntry:\n    exec(compile(open(sys.argv[1]).read(), 'install', 'exec'))\n"
              "except Exception as e:\n    print('\\n'.join(e._render_traceback_()))\n    sys.exit(1)\n")
    (cwd.parent / "install.py").write_text(_install_cell(NAMES[0]))
    env = {**os.environ, "MSAR_JAX_REPO": "", **({} if installed else {"PYTHONPATH": str(shadow)}), **(env or {})}
    return subprocess.run([sys.executable, "-c", script, str(cwd.parent / "install.py")], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)


def test_install_cell_without_a_source_says_what_to_do(tmp_path):
    (tmp_path / "colab").mkdir()
    out = _run_install_cell(tmp_path / "colab")
    assert out.returncode == 1, out.stderr
    assert out.stdout.strip().count("\n") == 0, out.stdout  # one line, no traceback
    assert out.stdout.startswith("InstallError: msar_jax is not installed and no source is set")
    assert "MSAR_JAX_REPO" in out.stdout and "make notebook-archive" in out.stdout


def test_install_cell_reports_a_failed_clone(tmp_path):
    (tmp_path / "colab").mkdir()
    out = _run_install_cell(tmp_path / "colab", {"MSAR_JAX_REPO": str(tmp_path / "no-such-repo")})
    assert out.returncode == 1, out.stderr
    assert out.stdout.startswith(f"InstallError: git clone {tmp_path / 'no-such-repo'} failed: fatal:")


def test_install_cell_rejects_an_archive_of_something_else(tmp_path):
    colab = tmp_path / "colab"
    (colab / "src" / "msar-jax").mkdir(parents=True)
    (colab / "src" / "msar-jax" / "README.md").write_text("not the project\n")
    with tarfile.open(colab / "msar-jax.tar.gz", "w:gz") as tar:
        tar.add(colab / "src" / "msar-jax", arcname="msar-jax")
    out = _run_install_cell(colab)
    assert out.returncode == 1 and "is not a checkout of msar-jax" in out.stdout, out.stdout + out.stderr


def test_notebook_archive_is_what_the_install_cell_unpacks(tmp_path):
    """``make notebook-archive`` packs the committed tree as msar-jax/; in a folder holding it (and
    no checkout above) the install cell unpacks it and finds a checkout with its configs."""
    colab = tmp_path / "colab"
    colab.mkdir()
    archive = colab / "msar-jax.tar.gz"
    subprocess.run(["make", "-s", "-C", str(REPO), "notebook-archive", f"NOTEBOOK_ARCHIVE={archive}"],
                   check=True, capture_output=True, timeout=120)
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    assert {"msar-jax/pyproject.toml", "msar-jax/configs/msar.py", "msar-jax/msar_jax/__init__.py"} <= names
    out = _run_install_cell(colab, installed=True)  # msar_jax imports: unpacked, found, nothing installed
    assert out.returncode == 0, out.stdout + out.stderr
    assert (colab / "msar-jax" / "configs" / "msar.py").is_file()
    assert out.stdout.startswith("msar_jax from "), out.stdout


@pytest.mark.parametrize("arg", ["smoke=1,block_size=1", "smoke=1,conv=0,fusion=mean"])
def test_capture_reproduces_the_model(arg):
    """``explorer.capture`` (which the explorer and depth-patterns notebooks use) reproduces the
    model's logits, every read's ``h`` through ``msar_read`` and the introspection weights, also
    for Full MSAR and the no-conv / mean-fusion ablations the notebooks do not run."""
    import jax
    import numpy as np

    from msar_jax import explorer
    from msar_jax.config import load_config
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
