# Everything a fresh machine needs: `make demo` and `make test` create the virtualenv and
# install what they use. Nothing has to be installed by hand.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# A CPU-only torch pinned *before* nixl: nixl depends on torch and would otherwise pull a
# multi-GB CUDA build. On GPU machines set TORCH_SPEC to the build you want.
TORCH_SPEC ?= torch==2.13.0

.PHONY: venv test demo bench plan clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test,bench,nixl,ucx]"
	touch $(STAMP)

test: venv
	$(PY) -m pytest -q

demo: venv
	$(PY) -m kvxfer.demo

bench: venv
	$(PY) benchmarks/bench_plan.py

plan: venv
	$(PY) -m kvxfer.cli plan

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis .benchmarks
