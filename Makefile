# Two commands set everything up: `make demo` and `make test`. Each creates or reuses .venv.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LIBTPU_VERSION := 0.0.48.1
LIBTPU := libtpu==$(LIBTPU_VERSION)
TPU_SITE := .tpu_site
LIBTPU_STAMP := $(TPU_SITE)/libtpu-$(LIBTPU_VERSION).dist-info

.PHONY: test test-slow demo venv clean-venv accounting bench-memory notebooks notebook-archive tpu-site tpu-estimate

venv: $(STAMP)

$(STAMP): pyproject.toml
	@bash tools/find_python312.sh $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --progress-bar off -e '.[dev]'
	@touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile

# the long-running cases (pytest -m slow); CI runs them after `make test`. They include the
# TPU compiles of tests/test_tpu_compile.py, hence libtpu (MSAR_TPU_CHECKS=0 skips those).
test-slow: $(STAMP) $(LIBTPU_STAMP)
	MSAR_TPU_SITE=$(TPU_SITE) $(PY) -m pytest -q -n 2 --dist loadfile -m slow

# libtpu for compile-only TPU checks on any machine (compile_check --topology, the TPU compile
# tests, benchmarks/tpu_estimate.py): the version jax[tpu]==0.11.2 pins, 689 MB, kept out of
# .venv so that CPU-only runs never load it; use it with PYTHONPATH=.tpu_site.
tpu-site: $(LIBTPU_STAMP)

$(LIBTPU_STAMP): | $(STAMP)
	$(PY) -m pip install -q --progress-bar off --upgrade --target $(TPU_SITE) $(LIBTPU)

# the TPU estimate table of BENCHMARKS.md: bytes per kernel over each chip's HBM bandwidth
tpu-estimate: $(STAMP) $(LIBTPU_STAMP)
	PYTHONPATH=$(TPU_SITE) $(PY) benchmarks/tpu_estimate.py --json results/tpu_estimate.json

demo: $(STAMP)
	$(PY) -m msar_jax.demo

accounting: $(STAMP)
	$(PY) -m msar_jax.accounting --config=configs/msar.py:size=paper_28b

# BENCHMARKS.md "Training memory at `base`": the `base` configs compiled for one H200 (JAX's CUDA
# plugin in .aot_site, msar_jax/deviceless_gpu.py) and paper_28b's per-chip shard on a v5p slice
bench-memory: $(STAMP) $(LIBTPU_STAMP)
	PYTHONPATH=.aot_site $(PY) benchmarks/bench_memory.py --topology h200 --full_batch --json results/memory_base_h200.json
	PYTHONPATH=$(TPU_SITE) $(PY) benchmarks/bench_memory.py --size paper_28b --topology v5p:4x4x4 --mesh fsdp=64

# Execute the notebooks at tiny size and store their outputs, so a code host shows the figures
# (about 2 minutes on 2 CPU cores; tools/execute_notebooks.py). Commit the notebooks after it.
notebooks: $(STAMP)
	$(PY) tools/execute_notebooks.py --write

# The committed tree (HEAD) as one archive for Colab: upload it next to a notebook and the
# notebook's first cell unpacks and installs it (the alternative: MSAR_JAX_REPO in that cell).
NOTEBOOK_ARCHIVE ?= build/msar-jax.tar.gz
notebook-archive:
	@mkdir -p $(dir $(NOTEBOOK_ARCHIVE))
	git archive --format=tar.gz --prefix=msar-jax/ -o $(NOTEBOOK_ARCHIVE) HEAD
	@echo "wrote $(NOTEBOOK_ARCHIVE) (HEAD, uncommitted changes not included): upload it to Colab's file panel"

clean-venv:
	rm -rf $(VENV)
