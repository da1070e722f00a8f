"""kvwire under vLLM's hybrid KV cache manager (``SupportsHMA``): two real vLLM 0.34 schedulers with a
hybrid model's two KV cache groups (layer 0 full attention, layer 1 a sliding window of ``WINDOW``
tokens, sharing one tensor as vLLM allocates them) and real kvwire workers over NIXL.

vLLM keeps HMA on with kvwire's connector (it would turn it off for a connector that is not
``SupportsHMA``), so P frees a sliding window's out-of-window blocks during the prefill; kvwire moves the
full-attention group's blocks whole and the window's from the block D's first recomputed token reads.
"""

from __future__ import annotations

import numpy as np
import pytest
from harness import (
    BS,
    TOKEN,
    Engine,
    MakeEngine,
    assert_d_decoded,
    assert_delivered,
    assert_zero_except,
    d_params,
    p_params,
    prompt,
    run,
)
from vllm.v1.request import RequestStatus

from kvwire.integrations.vllm.params import KvRole, OpKind

WINDOW = 32


def _prefill(p: Engine, rid: str, tokens: list[int], tid: str) -> dict[str, object]:
    p.add(rid, tokens, 1, p_params(tid))
    run([p], lambda: rid in p.outputs and any(o.req_id == rid for o in p.ops), f"P's prefill of {rid}")
    assert p.outputs[rid].new_token_ids == [TOKEN]
    params = p.outputs[rid].kv_transfer_params
    assert params is not None
    return dict(params)


def _first_window_block(n_tokens: int) -> int:
    """The window's first block D needs: the one holding token n - WINDOW (D recomputes token n - 1)."""
    return max(0, n_tokens - WINDOW) // BS


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_hma_full_and_sliding_window_groups_move_with_their_own_blocks(
    make_engine: MakeEngine, mode: str
) -> None:
    p = make_engine(KvRole.PRODUCER, mode, window=WINDOW)
    d = make_engine(KvRole.CONSUMER, mode, window=WINDOW)
    assert p.sched.connector._groups.hybrid and len(p.sched.kv_cache_config.kv_cache_groups) == 2
    n_tok = 5 * BS - 3  # 77 tokens: five blocks per group, the last partial
    n, first = -(-n_tok // BS), _first_window_block(n_tok)
    assert first == 2
    tokens = prompt(n_tok, 11)
    params = _prefill(p, "p1", tokens, "t1")
    send = p.op(OpKind.SEND, "p1")
    # kvwire's flat list: the full group's five blocks, then the window group's five (out-of-window: null).
    assert len(send.block_ids) == 2 * n and send.num_tokens == n_tok
    full_p, win_p = send.block_ids[:n], send.block_ids[n:]
    null = p.pool.null_block.block_id
    assert null not in full_p and null not in win_p[first:]
    # HMA at work: P already freed the window's earliest block, so it holds fewer than two groups' worth.
    assert null in win_p[:first] and p.held() < 2 * n

    d.add("d1", tokens, 3, params if mode == "pull" else d_params(p, "t1"))
    run([p, d], lambda: d.gone("d1") and p.gone("p1"), "the load and the decode")
    load = d.op(OpKind.LOAD, "d1")
    assert len(load.block_ids) == 2 * n
    full_d, win_d = load.block_ids[:n], load.block_ids[n:]
    assert_delivered(p, d, "t1", mode)
    assert_d_decoded(d, "d1", 3)
    # Every KV word of the full group, and of the window from its first needed block, as P computed it
    # (both groups live in layer 0's tensor, which layer 1 shares).
    assert np.array_equal(d.kv[0, full_d], p.kv[0, full_p])
    assert np.array_equal(d.kv[0, win_d[first:]], p.kv[0, win_p[first:]])
    assert_zero_except(d, full_d + win_d[first:])
    p.assert_clean()
    d.assert_clean()


def test_hma_window_block_already_freed_on_p_fails_the_load_at_once(make_engine: MakeEngine) -> None:
    """A prompt whose window starts a block exactly where P freed it (vLLM frees by the token after the
    prompt, D recomputes the prompt's last): P cannot send what D needs, says so at once (a DROP, D's
    registration fails), and D ends the request under vLLM's kv_load_failure_policy (0.34's default:
    fail); nothing lands on D."""
    p = make_engine(KvRole.PRODUCER, window=WINDOW)
    d = make_engine(KvRole.CONSUMER, window=WINDOW)
    n_tok = 4 * BS + WINDOW - 1  # 95: P frees blocks below token 64, D needs token 63 (block 3)
    tokens = prompt(n_tok, 12)
    d.add("d1", tokens, 2, d_params(p, "t2"))  # both legs at once: D registers while P prefills
    p.add("p1", tokens, 1, p_params("t2"))
    assert (n_tok - WINDOW + 1) % BS == 0 and _first_window_block(n_tok) == 3
    run([p, d], lambda: d.gone("d1") and p.gone("p1"), "the refused load and D's recompute")
    assert [o.kind for o in p.ops if o.req_id == "p1"] == [OpKind.DROP]
    assert d.reported.failed_recving == {"d1"}
    assert RequestStatus.RUNNING not in d.history["d1"]
    assert d.history["d1"][-1] is RequestStatus.FINISHED_ERROR and not d.reqs["d1"].output_token_ids
    assert not d.kv.any(), "nothing may land on D"
    p.assert_clean()
    d.assert_clean()
