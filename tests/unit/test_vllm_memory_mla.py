"""MLA's latent cache as vLLM hands it to ``register_kv_caches``: the 4-D ``[blocks, 1, block_size, latent]``
view of vLLM's KV cache interface (0.32's CPU build, 0.34) and the older 3-D one are one region per layer;
anything else (a head count, a token-major tensor read as block-major) is refused with a LayoutError."""

from __future__ import annotations

import numpy as np
import pytest

from kvwire.errors import LayoutError
from kvwire.integrations.vllm.memory import kv_from_vllm, layer_layout
from kvwire.kv.regions import view_of

BLOCKS, BLOCK, LATENT = 6, 16, 576


def caches(shape: tuple[int, ...], layers: int = 2) -> dict[str, np.ndarray]:
    return {f"model.layers.{i}.self_attn.attn": np.zeros(shape, dtype=np.float16) for i in range(layers)}


@pytest.mark.parametrize("shape", [(BLOCKS, 1, BLOCK, LATENT), (BLOCKS, BLOCK, LATENT)], ids=str)
def test_mla_latent_cache_is_one_region_per_layer(shape: tuple[int, ...]) -> None:
    kv = kv_from_vllm(caches(shape), num_layers=2, kv_heads=1, head_dim=LATENT, block_size=BLOCK, mla=True)
    assert kv.spec.mla and kv.num_blocks == BLOCKS and len(kv.regions()) == 2
    assert kv.spec.block_bytes(1) == BLOCK * LATENT * 2


@pytest.mark.parametrize(
    "array",
    [
        np.zeros((BLOCKS, 2, BLOCK, LATENT), dtype=np.float16),  # two "heads": not a latent cache
        np.zeros((BLOCKS, BLOCK, LATENT // 2), dtype=np.float16),  # another latent width
        np.zeros((BLOCK, BLOCKS, LATENT), dtype=np.float16).transpose(1, 0, 2),  # tokens outermost
        np.zeros((BLOCKS, LATENT, BLOCK), dtype=np.float16).transpose(0, 2, 1),  # latent not innermost
    ],
    ids=["heads", "width", "token-major", "latent-major"],
)
def test_other_tensors_are_refused(array: np.ndarray) -> None:
    with pytest.raises(LayoutError, match="MLA KV tensor"):
        layer_layout(view_of(array), BLOCK, 1, LATENT, mla=True)
