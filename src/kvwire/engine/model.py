"""The reference model in numpy: RMSNorm, RoPE, GQA attention over the paged cache, SwiGLU.

Math is float32; K and V are rounded to the cache's dtype when stored, and the attention always uses
the rounded values (the prefill uses them straight away, the single-token step reads them back).

Exactness: a prompt of n tokens is computed as ``prefill(tokens[:n-1])`` (batched forwards) and then
``step(tokens[n-1], n-1)``; every decode step is ``step``. Both work on one sequence at a time, so no
matmul ever mixes rows of two requests and results never depend on what else is running. Whatever
engine (and TP/PP layout) ran ``prefill``, the same cache bytes give the same ``step`` results.

The prefill runs in chunks of ``prefill_chunk(cfg)`` positions aligned to multiples of it, each chunk
reading the positions before it back from the cache. So the KV of a position in a whole chunk depends
only on the tokens up to that chunk's end, computed with the same array shapes whatever follows: this is
what lets the prefix cache (``engine.prefix_cache``) skip whole cached chunks (``prefill(..., start=s)``)
and still write the same bytes as a prefill from position 0. (One forward over all positions would not:
BLAS and numpy's pairwise sums round differently when the row count or key length changes.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvwire.engine.config import ModelConfig
from kvwire.engine.paged import PagedKV

_F32 = np.float32
# Query rows per chunk of the batched causal attention: bounds the score matrix's memory.
_PREFILL_CHUNK = 128
# Positions per prefill chunk (at least one KV block). 16 (one block) doubles a tiny model's prefill on
# this CPU (numpy's per-call cost over 4x more chunks); 64 costs ~1.1x one forward over all positions.
_PREFILL_CHUNK_TOKENS = 64


def prefill_chunk(cfg: ModelConfig) -> int:
    """Positions per prefill chunk: a multiple of the block size, so cached prefixes end on a chunk."""
    return cfg.block_size * max(1, _PREFILL_CHUNK_TOKENS // cfg.block_size)


@dataclass(frozen=True, slots=True)
class LayerWeights:
    attn_norm: np.ndarray  # [hidden]
    wqkv: np.ndarray  # [hidden, (q_heads + 2 kv_heads) head_dim]
    wo: np.ndarray  # [q_heads head_dim, hidden]
    mlp_norm: np.ndarray  # [hidden]
    w_gate_up: np.ndarray  # [hidden, 2 intermediate]
    w_down: np.ndarray  # [intermediate, hidden]


@dataclass(frozen=True, slots=True)
class Weights:
    embed: np.ndarray  # [vocab, hidden]
    layers: tuple[LayerWeights, ...]
    final_norm: np.ndarray
    lm_head: np.ndarray  # [hidden, vocab]

    @classmethod
    def random(cls, cfg: ModelConfig, seed: int) -> Weights:
        """Deterministic weights: the same seed gives the same bytes on every machine."""
        rng = np.random.default_rng(seed)

        def dense(fan_in: int, fan_out: int) -> np.ndarray:
            w: np.ndarray = rng.standard_normal((fan_in, fan_out)).astype(_F32)
            return w / _F32(np.sqrt(fan_in))

        def norm() -> np.ndarray:
            return (1.0 + 0.1 * rng.standard_normal(cfg.hidden)).astype(_F32)

        h, d = cfg.hidden, cfg.head_dim
        embed = rng.standard_normal((cfg.vocab_size, h)).astype(_F32)
        layers = tuple(
            LayerWeights(
                attn_norm=norm(),
                wqkv=dense(h, (cfg.q_heads + 2 * cfg.kv_heads) * d),
                wo=dense(cfg.q_heads * d, h),
                mlp_norm=norm(),
                w_gate_up=dense(h, 2 * cfg.intermediate),
                w_down=dense(cfg.intermediate, h),
            )
            for _ in range(cfg.num_layers)
        )
        return cls(embed=embed, layers=layers, final_norm=norm(), lm_head=dense(h, cfg.vocab_size))


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    ms = np.mean(x * x, axis=-1, keepdims=True)
    out: np.ndarray = x / np.sqrt(ms + _F32(eps)) * w
    return out


def silu(x: np.ndarray) -> np.ndarray:
    out: np.ndarray = x / (_F32(1.0) + np.exp(-x))
    return out


def _attend(scores: np.ndarray, values: np.ndarray) -> np.ndarray:
    """softmax(scores) @ values, normalising after the product (fewer passes over the scores).

    ``scores`` is consumed (overwritten in place).
    """
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    denom = scores.sum(axis=-1, keepdims=True)
    out: np.ndarray = (scores @ values) / denom
    return out


class Model:
    """Weights plus the two forward functions; holds no per-request state (the cache is passed in)."""

    def __init__(self, cfg: ModelConfig, seed: int = 0) -> None:
        self.cfg = cfg
        self.w = Weights.random(cfg, seed)
        half = cfg.head_dim // 2
        inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(half, dtype=np.float64) / half))
        angles = np.arange(cfg.max_model_len, dtype=np.float64)[:, None] * inv_freq[None, :]
        # A table, so that a position's rotation is the same bytes whichever batch it is computed in.
        self._cos = np.cos(angles).astype(_F32)
        self._sin = np.sin(angles).astype(_F32)
        self._kv_dtype = np.dtype(cfg.kv_dtype)
        self._scale = _F32(1.0 / np.sqrt(cfg.head_dim))

    # -- pieces --------------------------------------------------------------------------------------------
    def _rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """``x``: [n, heads, head_dim] at positions ``pos`` ([n])."""
        half = self.cfg.head_dim // 2
        cos = self._cos[pos][:, None, :]
        sin = self._sin[pos][:, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def _qkv(self, lw: LayerWeights, x: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, ...]:
        """Queries ``[q_heads, n, d]``; keys and values ``[kv_heads, n, d]`` rounded to the cache dtype."""
        c = self.cfg
        n, d = x.shape[0], c.head_dim
        qkv = rms_norm(x, lw.attn_norm, c.eps) @ lw.wqkv
        q = qkv[:, : c.q_heads * d].reshape(n, c.q_heads, d)
        k = qkv[:, c.q_heads * d : (c.q_heads + c.kv_heads) * d].reshape(n, c.kv_heads, d)
        v = qkv[:, (c.q_heads + c.kv_heads) * d :].reshape(n, c.kv_heads, d)
        q = self._rope(q, pos).transpose(1, 0, 2)
        k = np.ascontiguousarray(self._rope(k, pos).transpose(1, 0, 2), dtype=self._kv_dtype)
        v = np.ascontiguousarray(v.transpose(1, 0, 2), dtype=self._kv_dtype)
        return q, k, v

    def _mlp(self, lw: LayerWeights, x: np.ndarray) -> np.ndarray:
        gu = rms_norm(x, lw.mlp_norm, self.cfg.eps) @ lw.w_gate_up
        i = self.cfg.intermediate
        out: np.ndarray = (silu(gu[:, :i]) * gu[:, i:]) @ lw.w_down
        return out

    def _causal_attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, q0: int, k0: int) -> np.ndarray:
        """Causal (windowed) attention of one sequence: q [Hq, m, d] at positions ``q0..q0+m``, k/v
        [kvh, L, d] at positions ``k0..q0+m``. Returns [m, Hq * d]."""
        c = self.cfg
        kvh, g, m, d = c.kv_heads, c.group, q.shape[1], c.head_dim
        qg = (q * self._scale).reshape(kvh, g, m, d)
        kt = k.transpose(0, 2, 1)[:, None]  # [kvh, 1, d, L]
        vg = v[:, None]  # [kvh, 1, L, d]
        out = np.empty((kvh, g, m, d), dtype=_F32)
        w = c.window
        chunk = _PREFILL_CHUNK if w is None else w
        for qs in range(q0, q0 + m, chunk):
            qe = min(q0 + m, qs + chunk)
            lo = k0 if w is None else max(k0, qs - w + 1)
            scores = qg[:, :, qs - q0 : qe - q0] @ kt[..., lo - k0 : qe - k0]  # [kvh, g, c, L]
            qpos = np.arange(qs, qe)[:, None]
            kpos = np.arange(lo, qe)[None, :]
            masked = kpos > qpos
            if w is not None:
                masked |= qpos - kpos >= w
            scores += np.where(masked, _F32(-np.inf), _F32(0.0))
            out[:, :, qs - q0 : qe - q0] = _attend(scores, vg[:, :, lo - k0 : qe - k0])
        return out.reshape(c.q_heads, m, d).transpose(1, 0, 2).reshape(m, c.q_heads * d)

    # -- the two forward functions -------------------------------------------------------------------------
    def prefill(self, kv: PagedKV, block_ids: list[int], tokens: np.ndarray, start: int = 0) -> None:
        """The batched forward over positions ``[start, len(tokens))``: fills the cache, returns nothing.

        Runs in aligned chunks of ``prefill_chunk`` positions through all layers, each reading the
        positions before it (its window, for a windowed model) back from the cache; ``start`` (a multiple
        of the chunk) says the cache already holds ``[0, start)`` for these tokens: a prefix cache hit.
        """
        chunk = prefill_chunk(self.cfg)
        if start % chunk or not 0 <= start <= len(tokens):
            raise ValueError(f"prefill start {start} is not a multiple of {chunk} within the prompt")
        m = len(tokens)
        for pos in range(start, m, chunk):
            self._prefill_slice(kv, block_ids, tokens, pos, min(m, pos + chunk))

    def _prefill_slice(
        self, kv: PagedKV, block_ids: list[int], tokens: np.ndarray, start: int, end: int
    ) -> None:
        w = self.cfg.window
        k0 = 0 if w is None else max(0, start - w + 1)
        pos = np.arange(start, end)
        x = self.w.embed[tokens[start:end]]
        for layer, lw in enumerate(self.w.layers):
            q, k, v = self._qkv(lw, x, pos)
            kv.write(layer, block_ids, start, k, v)
            if k0 < start:
                pk, pv = kv.read_heads(layer, block_ids, k0, start)
                k, v = np.concatenate([pk, k], axis=1), np.concatenate([pv, v], axis=1)
            attn = self._causal_attention(q, k.astype(_F32), v.astype(_F32), start, k0)
            x = x + attn @ lw.wo
            x = x + self._mlp(lw, x)

    def step(self, kv: PagedKV, block_ids: list[int], token: int, pos: int) -> np.ndarray:
        """One token at position ``pos`` attending to the cache ``[0, pos]``: the logits ``[vocab]``."""
        c = self.cfg
        if not 0 <= pos < c.max_model_len:
            raise ValueError(f"position {pos} outside the model's {c.max_model_len}")
        x = self.w.embed[np.array([token])]
        lo = 0 if c.window is None else max(0, pos + 1 - c.window)
        for layer, lw in enumerate(self.w.layers):
            q, k, v = self._qkv(lw, x, np.array([pos]))
            kv.write(layer, block_ids, pos, k, v)
            keys, values = kv.read(layer, block_ids, lo, pos + 1)  # [Hq, L, d]
            scores = (q * self._scale) @ keys.transpose(0, 2, 1)  # [Hq, 1, L]
            attn = _attend(scores, values).reshape(1, c.q_heads * c.head_dim)
            x = x + attn @ lw.wo
            x = x + self._mlp(lw, x)
        logits: np.ndarray = (rms_norm(x, self.w.final_norm, c.eps) @ self.w.lm_head)[0]
        return logits
