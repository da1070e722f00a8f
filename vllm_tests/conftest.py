"""Environment for the vLLM 0.34 scheduler tests (run with ``.venv-vllm``, see requirements/vllm-0.34.txt).

Set before vLLM, transformers or NIXL are imported: no network for Hugging Face, and UCX without the
InfiniBand modules this machine lacks (they only slow its start-up and warn)."""

from __future__ import annotations

import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("UCX_MODULES", "^ib*")

# The project turns warnings into errors (pyproject.toml). Importing vLLM's scheduler imports torch's
# compiler, which warns about its own deprecated APIs: not kvwire's to fix, so import it once here, quietly.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import vllm.v1.core.sched.scheduler  # noqa: F401

from harness import make_engine, model_dir  # noqa: F401  (fixtures, shared by the test modules)
