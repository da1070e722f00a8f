#!/usr/bin/env bash
# The GPU check: kvwire's push and pull between two processes on a GPU, VRAM registered with NIXL, every
# byte compared, GB/s against raw NIXL from the same run (kvwire_tools.bench.gpu_check). Under 5 minutes on a GPU
# machine; with no GPU it runs the same transfers in DRAM (DEVICE=cpu), which is how CI keeps it working.
#
#   scripts/gpu-check.sh [--small] [--reps N]          # DEVICE=auto|cuda|cpu, JSON=out/gpu-check.json
#
# NIXL: used as installed; else installed with --no-deps, the build matching torch's CUDA (nixl-cu12 or
# nixl-cu13, 1.5.1), from WHEELS (a folder of wheels, for machines without a package index) when set.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then py=$PYTHON
elif [ -x .venv/bin/python ]; then py=.venv/bin/python
else py=python3
fi
# A checkout that was not pip-installed (a GPU box with its own python) imports kvwire from src/.
if ! "$py" -c 'import kvwire' 2>/dev/null; then export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"; fi

if ! "$py" -c 'import nixl._api' 2>/dev/null; then
  cuda=$("$py" -c 'import torch; print((torch.version.cuda or "12").split(".")[0])' 2>/dev/null || echo 12)
  site=${NIXL_SITE:-/tmp/kvwire-nixl-site}
  if [ -n "${WHEELS:-}" ]; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$WHEELS"/nixl-1.5.1-*.whl \
      "$WHEELS"/nixl_cu"$cuda"-1.5.1-*.whl
  else
    "$py" -m pip install -q --no-deps --target "$site" nixl==1.5.1 "nixl-cu$cuda==1.5.1"
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  echo "gpu-check: NIXL 1.5.1 (nixl-cu$cuda) installed in $site"
fi

json=${JSON:-out/gpu-check.json}
mkdir -p "$(dirname "$json")"
timeout "${TIMEOUT_S:-300}" "$py" -m kvwire.cli bench gpu-check --device "${DEVICE:-auto}" --json "$json" "$@"

# On a GPU, vLLM's worker side too (kvwire.integrations.vllm.WorkerSide, one process per TP rank, tensors laid
# out as vLLM 0.34 allocates them, here in VRAM): push TP 1->1, 2->1, 1->2 and pull, every KV word compared;
# different block sizes on P and D and a PP-2 P (test_vllm_worker_geometry), and layer-wise push, each layer
# fenced by a CUDA event before its write (test_vllm_worker_layerwise).
# It needs pytest and kvwire's dependencies (`pip install -e '.[dev]'`); WORKER_TESTS=0 skips it.
if [ "${WORKER_TESTS:-1}" = 1 ] && [ "${DEVICE:-auto}" != cpu ] \
  && "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  KVWIRE_TEST_DEVICE=cuda timeout "${TIMEOUT_S:-300}" "$py" -m pytest -q -p no:cacheprovider \
    -W ignore::DeprecationWarning tests/integration/test_vllm_worker_nixl.py \
    tests/integration/test_vllm_worker_geometry.py tests/integration/test_vllm_worker_layerwise.py
fi
