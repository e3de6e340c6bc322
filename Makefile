# The two commands: `make run` and `make test`. Both set up .venv/ first (idempotent, offline-from-hubs).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
PROTOS := $(wildcard protos/voicemesh/v1/*.proto)
STUBS := voicemesh/v1/.generated

.PHONY: setup run test unit integration bench lint format protos clean

setup: $(INSTALLED) $(STUBS)

$(PY):
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need Python 3.11 ($(PYTHON)); set PYTHON=..."; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# llama-cpp-python compiles from source on first install (~10 min on 2 cores); pip caches the wheel after.
$(INSTALLED): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e '.[local,dev]'
	touch $@

$(STUBS): $(PROTOS) $(INSTALLED)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. $(PROTOS)
	touch $@

protos: $(INSTALLED)
	rm -f $(STUBS)
	$(MAKE) $(STUBS)

run: setup
	$(VENV)/bin/voicemesh up

test: setup
	$(PY) -m pytest -q

unit: setup
	$(PY) -m pytest -q tests/unit

bench: setup
	$(PY) -m bench

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) voicemesh/v1/*_pb2*.py voicemesh/v1/*_pb2*.pyi $(STUBS)
