"""What ``KvwireConnector`` refuses at start under vLLM 0.34, and what it must not refuse."""

from __future__ import annotations

from types import SimpleNamespace as NS

from vllm.config import SpeculativeConfig

from kvwire.integrations.vllm.connector import KvwireConnector, _drafter_has_kv


def test_only_speculative_methods_with_a_drafter_kv_cache_are_refused() -> None:
    """A drafter's KV layers are not moved, so EAGLE, MTP and draft models are refused; n-gram and suffix
    decoding keep no KV of their own, and vLLM says so (``uses_draft_kv_cache``)."""
    assert hasattr(SpeculativeConfig, "uses_draft_kv_cache")  # the vLLM method the check reads
    assert not _drafter_has_kv(None)
    assert not _drafter_has_kv(NS(uses_draft_kv_cache=lambda: False))
    assert _drafter_has_kv(NS(uses_draft_kv_cache=lambda: True))
    assert _drafter_has_kv(NS(draft_model_config=object()))  # a vLLM without the method


def test_sleep_mode_is_refused_and_layerwise_false_asks_no_piecewise_graphs() -> None:
    assert KvwireConnector.supports_sleep_mode(None) is False
    assert KvwireConnector.requires_piecewise_for_cudagraph({"layerwise": "false"}) is False
    assert KvwireConnector.requires_piecewise_for_cudagraph({"layerwise": True}) is True
