# The two commands a fresh machine gets: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export UCX_MODULES ?= ^ib*
export PYTHONUNBUFFERED := 1

.PHONY: demo test lint typecheck unit bench clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	# NIXL declares torch; DRAM transfers do not need it, so skip its dependencies.
	$(BIN)/pip install --quiet --no-deps nixl==1.5.1 nixl-cu12==1.5.1
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kvwire demo

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

typecheck: $(STAMP)
	$(BIN)/mypy

test: lint typecheck
	$(BIN)/pytest -q

bench: $(STAMP)
	mkdir -p out
	for s in transfer descriptors handshake overhead e2e; do \
	  $(BIN)/kvwire bench $$s --json out/bench-$$s.json --plot out/bench-$$s.png || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
