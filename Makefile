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

.PHONY: venv deps test demo bench plan clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test,bench,nixl,ucx,etcd,metrics,plot]"
	touch $(STAMP)

# System packages some tests need: etcd (the metadata directory) and iproute2 (network
# namespaces). Installed with apt-get when missing and we are root; a no-op once present.
deps:
	@if command -v etcd >/dev/null 2>&1 && command -v ip >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "deps: installing etcd-server and iproute2 with apt-get"; \
		export DEBIAN_FRONTEND=noninteractive; log=$$(mktemp); \
		if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends etcd-server iproute2; } \
			>$$log 2>&1; then cat $$log; rm -f $$log; exit 1; fi; rm -f $$log; \
	else echo "deps: etcd or iproute2 missing: apt-get install -y etcd-server iproute2 (their tests skip)"; fi

test: venv deps
	$(PY) -m pytest -q

demo: venv
	$(VENV)/bin/kvxfer demo

bench: venv
	$(PY) benchmarks/bench_plan.py

plan: venv
	$(VENV)/bin/kvxfer plan

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis .benchmarks
