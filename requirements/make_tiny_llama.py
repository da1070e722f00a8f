#!/usr/bin/env python3
"""Write a tiny random-weight Llama model + tokenizer for offline vLLM tests.

Usage: python make_tiny_llama.py OUT_DIR [--dtype bfloat16|float32] [--seed 0]

Fully offline and deterministic (fixed seed, fixed vocabulary): running it
twice gives byte-identical safetensors and tokenizer files. Takes a few
seconds. Load with vLLM via `--model OUT_DIR` and HF_HUB_OFFLINE=1.

Architecture: LlamaForCausalLM, 2 layers, hidden 256, 4 attention heads,
2 KV heads, head_dim 64, intermediate 512, vocab 512, max positions 4096.

Tokenizer: a WordLevel tokenizer over a fixed vocabulary: 4 special tokens
(<unk>=0, <s>=1 BOS, </s>=2 EOS, <pad>=3) plus 508 words "w000".."w507",
whitespace-split. Text made of those words is one token per word, so prompt
lengths are exact: N words -> N tokens + 1 BOS (added by the post-processor).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

VOCAB_SIZE = 512
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0..3


def build_tokenizer(out_dir: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, processors

    words = [f"w{i:03d}" for i in range(VOCAB_SIZE - len(SPECIALS))]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins tokens with spaces
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A",
        pair="<s> $A <s> $B",
        special_tokens=[("<s>", 1)],
    )
    tok.save(os.path.join(out_dir, "tokenizer.json"))

    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump(
            {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"},
            f, indent=2, sort_keys=True,
        )


def build_model(out_dir: str, dtype_name: str, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32,
             "float16": torch.float16}[dtype_name]
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        hidden_act="silu",
        initializer_range=0.02,
    )
    try:
        cfg.dtype = dtype_name  # transformers >= 4.56 key
    except Exception:
        cfg.torch_dtype = dtype_name  # older transformers key
    with torch.no_grad():
        model = LlamaForCausalLM(cfg)
        # Re-draw every parameter from the seeded generator so the result is
        # independent of transformers' init order/implementation details.
        g = torch.Generator().manual_seed(seed)
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        model = model.to(dtype)
    model.save_pretrained(out_dir, safe_serialization=True)
    # generation_config.json is written by save_pretrained; keep greedy defaults.


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.makedirs(args.out_dir, exist_ok=True)
    build_tokenizer(args.out_dir)
    build_model(args.out_dir, args.dtype, args.seed)
    print(f"wrote tiny llama ({args.dtype}, seed {args.seed}) to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
