"""The model identity a vLLM engine puts in kvwire's compat hash (no vLLM import: unit-testable).

Two engines whose weights differ must never exchange KV, and a refusal must say why. The served name
alone does not tell weights apart: the same name may be served at another revision or in another dtype
(the KV dtype is compared separately, but bfloat16 and float16 weights give different KV values even with
a float16 cache). So the id is ``model=<name>;revision=<rev>;dtype=<dtype>``, and a mismatch names the
part that differs (``protocol.compat.describe_mismatch``).
"""

from __future__ import annotations

from typing import Any


def vllm_model_id(model_config: Any) -> str:
    """The compat hash's model id of a vLLM ``ModelConfig`` (``served_model_name`` or ``model``, its
    ``revision`` or ``main``, its weights' ``dtype``)."""
    name = model_config.served_model_name or model_config.model
    if isinstance(name, list | tuple):  # vLLM accepts several served names; the first is the canonical one
        name = name[0] if name else model_config.model
    revision = getattr(model_config, "revision", None) or "main"
    dtype = str(getattr(model_config, "dtype", "auto")).removeprefix("torch.")
    return f"model={name};revision={revision};dtype={dtype}"
