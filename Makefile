# Two commands set everything up: `make demo` and `make test`. Each creates or reuses .venv.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-slow demo venv clean-venv accounting bench-memory

venv: $(STAMP)

$(STAMP): pyproject.toml
	@bash tools/find_python312.sh $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --progress-bar off -e '.[dev]'
	@touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile

# the long-running cases (pytest -m slow); CI runs them after `make test`
test-slow: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile -m slow

demo: $(STAMP)
	$(PY) -m msar_jax.demo

accounting: $(STAMP)
	$(PY) -m msar_jax.accounting --config=configs/msar.py:size=paper_28b

bench-memory: $(STAMP)
	$(PY) experiments/bench_memory.py

clean-venv:
	rm -rf $(VENV)
