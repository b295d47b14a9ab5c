# flexoffload: `make run` and `make test` set everything up on a fresh machine first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
CACHE  := $(or $(FLEXOFFLOAD_CACHE),$(HOME)/.cache/flexoffload)
PROMPT ?= def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n
MEM    ?= 0.5x

.PHONY: setup native models run test test-fast upstream-test server-test bench clean

setup: $(VENV)/.installed native

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# the native build also leaves the Python-only llama-cpp-python wheel in the cache
native: $(VENV)/bin/python
	PYTHON=$(PY) scripts/build_native

$(VENV)/.installed: pyproject.toml | native
	$(PY) -m pip install --quiet $(CACHE)/wheels/llama_cpp_python-0.3.36-*.whl
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

models: setup
	$(VENV)/bin/flexoffload models fetch

run: models
	$(VENV)/bin/flexoffload run --mem $(MEM) --enforce -n 96 --temp 0 -p "$$(printf '$(PROMPT)')"

# the layers contract first (pyproject.toml: a module imports only from the layers below its own), then no import
# circle (imports inside functions counted), then the tests
test: models
	$(VENV)/bin/lint-imports
	$(PY) scripts/checks/import_circles.py flexoffload
	$(PY) -m pytest -q

# llama.cpp's own tests (ctest) on the patched tree, network tests excluded (CI runs it after `make test`)
upstream-test: setup
	scripts/upstream_tests

# llama.cpp's own server tests (tools/server/tests/unit of the pinned tree) against `flexoffload serve`, on a synthetic
# model; the tests that do not apply are listed with their reasons in scripts/server_tests (about 8 minutes)
server-test: setup
	scripts/server_tests

test-fast: setup
	$(VENV)/bin/lint-imports
	$(PY) scripts/checks/import_circles.py flexoffload
	$(PY) -m pytest -q -m "not integration"

bench: models
	$(VENV)/bin/flexoffload bench --mem 0.3x,0.5x,0.7x,1.0x --strategies mmap -r 3 -n 32 -o results/mmap_qwen1.5b.csv

clean:
	rm -rf $(VENV) build vendor *.egg-info
