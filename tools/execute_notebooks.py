"""Execute the notebooks (notebooks/*.ipynb) top to bottom at tiny size, optionally storing the outputs.

``make notebooks`` runs ``python tools/execute_notebooks.py --write``: each notebook runs in a fresh
kernel (this Python) in ``notebooks/``, its parameter cell shrunk through the ``MSAR_NOTEBOOK_*``
environment variables (``TINY``), and is written back with its outputs, tidied so a code host shows
them as a reader would see them: progress bars reduced to their final state, widget views and
widget state dropped (a code host cannot render them), machine paths replaced by ``<repo>`` and
``<runs>``, and the code it ran recorded as a hash (``tests/test_notebooks.py`` checks the stored
outputs belong to the current cells). The test suite executes the same way without writing.

All three share one fresh runs folder: the MSAR checkpoint that ``quickstart`` trains is the one
``msar_explorer`` (real-activation section) and ``depth_patterns`` load.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO_ROOT / "notebooks"
NAMES = ("quickstart", "msar_explorer", "depth_patterns")  # in this order: quickstart trains the checkpoint

# 8 steps of batch 4 x 32 tokens: every cell runs (training, checkpoints, eval, plots) in about a
# minute per notebook on 2 CPU cores; the explorer's real-activation switch on.
TINY = {
    "MSAR_NOTEBOOK_STEPS": "8",
    "MSAR_NOTEBOOK_BATCH": "4",
    "MSAR_NOTEBOOK_SEQ_LEN": "32",
    "MSAR_NOTEBOOK_FAST_COMPILE": "1",
    "MSAR_NOTEBOOK_REAL": "1",
}
# XLA:CPU's expensive optimisation passes cost more compile time than they save at this size.
FAST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# Inline figures as PNG at 80 dpi: readable on a code host, about 20-40 kB each.
KERNEL_ARGS = ["--InlineBackend.figure_formats={'png'}", "--InlineBackend.rc={'figure.dpi': 80}"]
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
HASH_KEY = "msar_jax"


def code_hash(nb) -> str:
    """sha256 of the notebook's code cells, in order: what the stored outputs were produced by."""
    h = hashlib.sha256()
    for cell in nb.cells:
        if cell.cell_type == "code":
            h.update(cell.source.encode("utf-8") + b"\0")
    return h.hexdigest()


# A tqdm progress-bar line ("train msar:  38%|███▊      | 3/8 [00:27<00:39, ...]") and the warning
# tqdm.auto gives when ipywidgets is missing (two lines): a reader needs neither.
PROGRESS_LINE = re.compile(r"^[^|\n]*:\s*\d+%\|")
WIDGET_NOISE = re.compile(r"TqdmWarning: IProgress not found|^\s*from \.autonotebook import tqdm as notebook_tqdm")


def _merge_streams(outputs: list) -> list:
    merged = []
    for out in outputs:
        prev = merged[-1] if merged else None
        if out.output_type == "stream" and prev is not None and prev.output_type == "stream" and prev.name == out.name:
            prev.text += out.text
        else:
            merged.append(out)
    return merged


def _tidy_streams(outputs: list) -> list:
    """Streams as a terminal leaves them: each line's text after its last carriage return, each
    progress bar only its final line, blank stderr lines (tqdm's clearing) and widget noise dropped."""
    outputs = _merge_streams(outputs)
    lines = {i: [line.rsplit("\r", 1)[-1] for line in out.text.split("\n")]
             for i, out in enumerate(outputs) if out.output_type == "stream"}
    final_bar = {}  # bar description -> (output, line) of its last state
    for i, text in lines.items():
        for j, line in enumerate(text):
            if PROGRESS_LINE.match(line):
                final_bar[line.split(":", 1)[0].strip()] = (i, j)
    keep_bars = set(final_bar.values())
    tidy = []
    for i, out in enumerate(outputs):
        if i in lines:
            text = [line for j, line in enumerate(lines[i])
                    if not (PROGRESS_LINE.match(line) and (i, j) not in keep_bars) and not WIDGET_NOISE.search(line)
                    and not (out.name == "stderr" and j < len(lines[i]) - 1 and not line.strip())]
            out.text = "\n".join(text)
            if not out.text.strip():
                continue
        tidy.append(out)
    return _merge_streams(tidy)


def tidy(nb, replacements: dict[str, str]):
    """Outputs as a code host should store them (see the module docstring); ``nb`` is changed in place."""
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)  # nbclient's timestamps: noise in every diff
        if cell.cell_type != "code":
            continue
        cell.outputs = _tidy_streams([out for out in cell.outputs if WIDGET_MIME not in out.get("data", {})])
    text = json.dumps([c.outputs for c in nb.cells if c.cell_type == "code"])
    for old, new in sorted(replacements.items(), key=lambda kv: -len(kv[0])):
        text = text.replace(json.dumps(old)[1:-1], json.dumps(new)[1:-1])
    outputs = iter(json.loads(text))
    import nbformat

    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = [nbformat.from_dict(o) for o in next(outputs)]
    nb.metadata[HASH_KEY] = {"executed_code_sha256": code_hash(nb), "parameters": dict(TINY)}
    return nb


def execute(name: str, runs_dir: Path, xla_flags: str = FAST_XLA_FLAGS, timeout: int = 300):
    """Run ``notebooks/<name>.ipynb`` at tiny size (runs under ``runs_dir``); the executed notebook,
    not written anywhere. A failing cell raises ``nbclient.exceptions.CellExecutionError``."""
    import nbclient
    import nbformat

    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    env = dict(TINY, MSAR_NOTEBOOK_RUNS=str(runs_dir), MSAR_NOTEBOOK_SEARCH=str(runs_dir),
               JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags)  # one host CPU device
    old = dict(os.environ)
    os.environ.update(env)  # the kernel inherits the environment
    try:
        client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3", extra_arguments=KERNEL_ARGS,
                                         resources={"metadata": {"path": str(NOTEBOOKS)}})
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(old)
    return nb


def main(argv=None) -> int:
    import nbformat

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(NAMES), help=f"notebooks (default: all, {', '.join(NAMES)})")
    parser.add_argument("--write", action="store_true", help="store the outputs in the notebooks")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in NAMES]
    if unknown:
        print(f"error: unknown notebook {unknown[0]!r}; choose from {', '.join(NAMES)}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="msar_notebook_runs_") as runs:
        runs_dir = Path(runs).resolve()
        replacements = {str(runs_dir): "<runs>", str(REPO_ROOT): "<repo>", str(Path.home()): "~"}
        for name in (n for n in NAMES if n in args.names):
            print(f"executing notebooks/{name}.ipynb", flush=True)
            nb = tidy(execute(name, runs_dir), replacements)
            if args.write:
                nbformat.write(nb, NOTEBOOKS / f"{name}.ipynb")
                size = (NOTEBOOKS / f"{name}.ipynb").stat().st_size
                print(f"  wrote notebooks/{name}.ipynb ({size / 1e3:.0f} kB)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
