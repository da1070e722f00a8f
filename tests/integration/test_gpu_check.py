"""The GPU check (scripts/gpu-check.sh, ``kvwire bench gpu-check``) on the CPU fallback: the same two
processes, real NIXL, every byte compared, so the script is known to work the day a GPU runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvwire.testing.buffer_peer import pattern
from kvwire_tools.bench.gpu_check import SMALL_CASES, DeviceBuffer, pick_device

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"


def test_script_parses() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], check=False).returncode == 0


@pytest.mark.nixl
def test_script_cpu_fallback_moves_every_byte(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check.json"
    env = {**os.environ, "DEVICE": "cpu", "JSON": str(out), "PYTHON": sys.executable, "TIMEOUT_S": "120"}
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--small", "--reps", "2"], env=env, capture_output=True, text=True, timeout=150
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["suite"] == "gpu-check" and doc["ok"] is True
    assert doc["environment"]["device"] == "cpu"
    rows = {(r["case"], r["op"]): r for r in doc["cases"]}
    assert set(rows) == {(c.name, op) for c in SMALL_CASES for op in ("push", "pull")}
    for case in SMALL_CASES:
        for op in ("push", "pull"):
            row = rows[(case.name, op)]
            assert row["checked_blocks"] == case.blocks
            assert row["bad_blocks"] == 0 and row["dirty_untouched_blocks"] == 0
            assert row["kvwire_gbps"] > 0 and row["raw_nixl_gbps"] > 0


def test_compare_finds_wrong_and_stray_bytes() -> None:
    block, seed = 64, 5
    buf = DeviceBuffer("cpu", 8 * block)
    src_idx, dst_idx = [0, 1, 2], [5, 3, 7]
    want = pattern(buf.nbytes, seed).reshape(-1, block)
    view = buf._array.reshape(-1, block)
    view[dst_idx] = want[src_idx]
    assert buf.compare(block, seed, src_idx, dst_idx) == {
        "checked_blocks": 3, "bad_blocks": 0, "dirty_untouched_blocks": 0,
    }  # fmt: skip
    view[3, 10] ^= 0xFF  # one flipped byte in a block that was sent
    view[0, 0] = 1  # a byte written into a block that was not
    assert buf.compare(block, seed, src_idx, dst_idx) == {
        "checked_blocks": 3, "bad_blocks": 1, "dirty_untouched_blocks": 1,
    }  # fmt: skip
    buf.zero()
    assert not np.any(buf._array)


def test_cuda_asked_without_a_gpu_is_a_clear_error() -> None:
    import torch

    if torch.cuda.is_available():
        assert pick_device("cuda") == "cuda"
        return
    with pytest.raises(SystemExit, match="torch sees no GPU"):
        pick_device("cuda")
    assert pick_device("auto") == "cpu"
