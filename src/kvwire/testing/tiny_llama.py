"""A tiny Llama-architecture model with random weights and a word-level tokenizer, made offline.

For real vLLM engines in tests and benchmarks (no hub access here). Deterministic: the same seed gives
byte-identical files. Run it with the Python of a vLLM environment (it needs torch, transformers and
tokenizers): ``python -m kvwire.testing.tiny_llama OUT_DIR``.

Geometry: 2 layers, hidden 256, 4 attention heads, 2 KV heads of head_dim 64 (vLLM's CPU attention needs
head_dim >= 64), vocabulary 512. The tokenizer knows ``<unk> <s> </s> <pad>`` and the words ``w000`` ..
``w507``, whitespace-split, with ``<s>`` prepended: a prompt of N words is exactly N + 1 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

VOCAB_SIZE = 512
SPECIALS = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0..3
NUM_WORDS = VOCAB_SIZE - len(SPECIALS)


def prompt_of(num_words: int, seed: int) -> str:
    """A prompt of exactly ``num_words`` words (``num_words + 1`` tokens), different per seed."""
    return " ".join(f"w{(seed * 7919 + i * 37) % NUM_WORDS:03d}" for i in range(num_words))


def write_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {tok: i for i, tok in enumerate([*SPECIALS, *(f"w{i:03d}" for i in range(NUM_WORDS))])}
    tok: Any = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(out / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        # A chat template of the words alone, so chat through vLLM's /v1/chat/completions can be compared
        # with the same engine's; a router that rendered chat itself (<|role|> lines) gives other tokens.
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}",
        **special,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=1, sort_keys=True))


def fill_random(model: Any, seed: int) -> None:
    """Every parameter drawn from one seeded generator: independent of transformers' init order."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)


def write_model(out: Path, seed: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg: Any = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2, pad_token_id=3, hidden_act="silu",
    )  # fmt: skip
    save_random(LlamaForCausalLM, cfg, out, seed)


def save_random(model_class: Any, cfg: Any, out: Path, seed: int) -> None:
    """Build ``model_class(cfg)`` with ``fill_random``'s weights and save it to ``out`` in bfloat16."""
    import torch

    cfg.dtype = "bfloat16"
    with torch.no_grad():
        model: Any = model_class(cfg)
        fill_random(model, seed)
        model = model.to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)


def run_cli(argv: list[str] | None, description: str, write: Callable[[Path, int], None]) -> int:
    """``python -m`` entry of a tiny model module: the tokenizer, then ``write(out_dir, seed)``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_tokenizer(args.out_dir)
    write(args.out_dir, args.seed)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(argv, "write a tiny random-weight Llama model and tokenizer", write_model)


if __name__ == "__main__":
    raise SystemExit(main())
