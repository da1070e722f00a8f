"""``kvwire bench gpu-check`` (``scripts/gpu-check.sh``): kvwire's data path on a GPU, every byte checked.

Two processes, each with its own NIXL agent and one registered buffer on the chosen device (``cuda``: a torch
tensor in VRAM, registered as ``MemKind.VRAM``; ``cpu``: a numpy array in DRAM, the fallback that runs on any
machine, so the script is tested where no GPU is lent). This process plays P, a spawned child plays D:

* **push**: P WRITEs scattered blocks of its buffer into D's, a notification attached, as kvwire's producer
  does; D waits for the notification, then compares every byte of every block it was sent and checks that
  the blocks it was not sent are still zero;
* **pull**: D READs blocks of P's buffer into its own, as kvwire's pull consumer does; same comparison;
* **GB/s** of each case through kvwire's ``Agent`` (``post_array`` + ``status`` polls + ``release``, what the
  connector does per request) against raw NIXL (one prepared transfer reposted, no kvwire code), median of
  ``--reps`` runs after one warm-up, both from this run: the ratio is the figure to read.

Exit status 1 when any byte differs or any transfer fails. The JSON (``--json``) holds the machine, the
device, NIXL's version and UCX's transport settings beside the cases.
"""

from __future__ import annotations

import argparse
import os
import time
from importlib import metadata
from typing import Any

import numpy as np

from kvwire.errors import TransferFailed
from kvwire.testing.buffer_peer import pattern
from kvwire.testing.child import CommandChild, serve_commands
from kvwire.transport import MemKind, XferOp, XferStatus, make_agent_name, new_incarnation
from kvwire_tools.bench.cases import Case, buffer_bytes, layout, repost_raw
from kvwire_tools.bench.common import envelope, gbps, median_seconds, print_table, write_json

SEED = 11
POLL_LIMIT_S = 60.0
NOTIF_WAIT_S = 30.0


# A 70B-class request's KV is a few GiB in thousands of 16-128 KiB blocks; the contiguous case is NIXL's best.
CUDA_CASES = (
    Case("1x1GiB", 1, 1 << 30, False),
    Case("8192x64KiB", 8192, 64 << 10, True),
    Case("4096x16KiB", 4096, 16 << 10, True),
)
CPU_CASES = (Case("1x64MiB", 1, 64 << 20, False), Case("1024x16KiB", 1024, 16 << 10, True))
SMALL_CASES = (Case("1x1MiB", 1, 1 << 20, False), Case("64x4KiB", 64, 4 << 10, True))


class DeviceBuffer:
    """One buffer on ``device``: its address, its NIXL memory kind, and pattern/zero/compare on the device."""

    def __init__(self, device: str, nbytes: int) -> None:
        self.device = device
        self.nbytes = nbytes
        self._tensor: Any = None
        self._want: tuple[int, np.ndarray] | None = None
        if device == "cuda":
            import torch

            self._tensor = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
            self.addr = int(self._tensor.data_ptr())
            self.kind, self.device_id = MemKind.VRAM, int(self._tensor.device.index or 0)
        else:
            self._array = np.zeros(nbytes, dtype=np.uint8)
            self.addr, self.kind, self.device_id = int(self._array.ctypes.data), MemKind.DRAM, 0

    def _pattern(self, seed: int) -> np.ndarray:
        # One pattern per seed, kept: regenerating 1 GiB of it for every comparison costs seconds.
        if self._want is None or self._want[0] != seed:
            self._want = (seed, pattern(self.nbytes, seed))
        return self._want[1]

    @property
    def owner(self) -> object:
        return self._tensor if self._tensor is not None else self._array

    def _from_host(self, host: np.ndarray) -> Any:
        import torch

        return torch.from_numpy(host).to(self._tensor.device)

    def fill_pattern(self, seed: int) -> None:
        if self._tensor is not None:
            import torch

            self._tensor.copy_(self._from_host(self._pattern(seed)))
            torch.cuda.synchronize()
        else:
            self._array[:] = self._pattern(seed)

    def zero(self) -> None:
        if self._tensor is not None:
            import torch

            self._tensor.zero_()
            torch.cuda.synchronize()
        else:
            self._array[:] = 0

    def compare(self, block: int, seed: int, src_idx: list[int], dst_idx: list[int]) -> dict[str, int]:
        """Blocks ``dst_idx`` of this buffer against blocks ``src_idx`` of ``pattern(nbytes, seed)``; every
        other block must still be zero."""
        want_host = self._pattern(seed).reshape(-1, block)[np.asarray(src_idx)]
        untouched = np.ones(self.nbytes // block, dtype=bool)
        untouched[np.asarray(dst_idx)] = False
        if self._tensor is not None:
            import torch

            blocks = self._tensor.view(-1, block)
            got = blocks[torch.as_tensor(dst_idx, device=self._tensor.device)]
            bad = int((got != self._from_host(np.ascontiguousarray(want_host))).any(dim=1).sum().item())
            rest = blocks[torch.from_numpy(untouched).to(self._tensor.device)]
            dirty = int(rest.any(dim=1).sum().item())
        else:
            blocks_np = self._array.reshape(-1, block)
            bad = int(np.count_nonzero((blocks_np[np.asarray(dst_idx)] != want_host).any(axis=1)))
            dirty = int(np.count_nonzero(blocks_np[untouched].any(axis=1)))
        return {"checked_blocks": len(dst_idx), "bad_blocks": bad, "dirty_untouched_blocks": dirty}


class Side:
    """One process's half: a kvwire ``NixlAgent`` with one registered ``DeviceBuffer``. P runs one in this
    process; D runs one in the child, driven by ``serve_commands`` (so every method is a command)."""

    def __init__(self, role: str, device: str, nbytes: int) -> None:
        from kvwire.transport.nixl import NixlAgent

        self.agent = NixlAgent(make_agent_name(f"gpu-check-{role}", new_incarnation(), 0, 0))
        self.buf = DeviceBuffer(device, nbytes)
        self.agent.register_range(
            self.buf.addr, nbytes, self.buf.kind, self.buf.device_id, owner=self.buf.owner
        )

    def info(self) -> tuple[str, bytes, int, int]:
        return self.agent.name, self.agent.metadata(), self.buf.addr, self.buf.device_id

    def load(self, metadata: bytes) -> str:
        return self.agent.add_peer(metadata)

    def fill(self, seed: int) -> None:
        self.buf.fill_pattern(seed)

    def zero(self) -> None:
        self.buf.zero()

    def compare(self, block: int, seed: int, src_idx: list[int], dst_idx: list[int]) -> dict[str, int]:
        return self.buf.compare(block, seed, src_idx, dst_idx)

    def wait_notif(self, sender: str, timeout_s: float) -> list[bytes]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = self.agent.drain_notifs().get(sender)
            if got:
                return got
        raise TransferFailed(f"no notification from {sender} within {timeout_s} s")

    def _arrays(
        self, remote_addr: int, remote_dev: int, block: int, local_idx: list[int], remote_idx: list[int]
    ) -> tuple[np.ndarray, np.ndarray]:
        n = len(local_idx)
        lo = np.empty((n, 3), dtype=np.int64)
        re = np.empty((n, 3), dtype=np.int64)
        lo[:, 0] = self.buf.addr + np.asarray(local_idx, dtype=np.int64) * block
        re[:, 0] = remote_addr + np.asarray(remote_idx, dtype=np.int64) * block
        lo[:, 1] = re[:, 1] = block
        lo[:, 2], re[:, 2] = self.buf.device_id, remote_dev
        return lo, re

    def transfer(self, op: str, peer: str, remote: tuple[int, int], block: int, local_idx: list[int],
                 remote_idx: list[int], notif: bytes | None = None) -> None:  # fmt: skip
        """One transfer through kvwire's ``Agent``, as the connector posts it: post_array, polls, release."""
        lo, re = self._arrays(remote[0], remote[1], block, local_idx, remote_idx)
        handle = self.agent.post_array(XferOp(op), lo, re, peer, notif, self.buf.kind)
        try:
            deadline = time.monotonic() + POLL_LIMIT_S
            state = self.agent.status(handle)
            while state is XferStatus.IN_PROGRESS and time.monotonic() < deadline:
                state = self.agent.status(handle)
            if state is not XferStatus.DONE:
                raise TransferFailed(f"{op} of {len(local_idx)} x {block} B ended {state.value}")
        finally:
            self.agent.release(handle)

    def time_kvwire(self, op: str, peer: str, remote: tuple[int, int], block: int, local_idx: list[int],
                    remote_idx: list[int], reps: int) -> float:  # fmt: skip
        return median_seconds(lambda: self.transfer(op, peer, remote, block, local_idx, remote_idx), reps)

    def time_raw(self, op: str, peer: str, remote: tuple[int, int], block: int, local_idx: list[int],
                 remote_idx: list[int], reps: int) -> float:  # fmt: skip
        """The same transfer in raw NIXL: both lists prepared once, one handle made once and reposted."""
        lo, re = self._arrays(remote[0], remote[1], block, local_idx, remote_idx)
        raw = self.agent.raw_agent
        local = raw.prep_xfer_dlist("NIXL_INIT_AGENT", lo.view(np.uint64), self.buf.kind.value)
        rem = raw.prep_xfer_dlist(peer, re.view(np.uint64), self.buf.kind.value)
        idx = np.arange(len(local_idx), dtype=np.int32)
        xfer = raw.make_prepped_xfer(op, local, idx, rem, idx, b"")

        try:
            return median_seconds(lambda: repost_raw(raw, xfer, f"raw NIXL {op}", POLL_LIMIT_S), reps)
        finally:
            raw.release_xfer_handle(xfer)
            raw.release_dlist_handle(local)
            raw.release_dlist_handle(rem)

    def close(self) -> None:
        self.agent.close()


def _serve_d(conn: Any, device: str, nbytes: int) -> None:
    side = Side("d", device, nbytes)
    serve_commands(conn, side, side.close, idle=side.agent.progress)


class _DChild(CommandChild):
    def __init__(self, device: str, nbytes: int) -> None:
        import functools

        super().__init__(functools.partial(_serve_d, device=device, nbytes=nbytes), call_timeout_s=300.0)

    def call_pumping(self, p: Side, cmd: str, **kwargs: Any) -> Any:
        """A command during which P's agent must make progress (D's READ of P's memory over TCP needs it)."""
        self.send(cmd, **kwargs)
        deadline = time.monotonic() + 300.0
        # A tight loop: a transfer that needs P's progress (a rendezvous over TCP) waits for each poll.
        while not self._conn.poll(0) and time.monotonic() < deadline:
            p.agent.progress()
        return self.recv(cmd, timeout_s=0)


def pick_device(asked: str) -> str:
    """``cuda`` when asked for (or ``auto`` and torch sees a GPU), else ``cpu``; a clear error when ``cuda``
    was asked for and cannot be had."""
    if asked == "cpu":
        return "cpu"
    try:
        import torch

        has_gpu = bool(torch.cuda.is_available())
    except ImportError:
        has_gpu = False
    if asked == "cuda" and not has_gpu:
        raise SystemExit("gpu-check: --device cuda but torch sees no GPU (or torch is not installed)")
    return "cuda" if has_gpu else "cpu"


def _row(case: Case, op: str, check: dict[str, int], kv_s: float, raw_s: float) -> dict[str, Any]:
    return {
        "case": case.name, "op": op, "bytes": case.nbytes, "blocks": case.blocks, "block_bytes": case.block,
        "kvwire_gbps": gbps(case.nbytes, kv_s), "raw_nixl_gbps": gbps(case.nbytes, raw_s),
        "ratio_vs_raw": raw_s / kv_s if kv_s > 0 else float("nan"), **check,
    }  # fmt: skip


def run_check(device: str, cases: tuple[Case, ...], reps: int) -> list[dict[str, Any]]:
    """Push and pull every case between this process (P) and a child (D); bytes compared on the device."""
    size = buffer_bytes(cases)
    rng = np.random.default_rng(SEED)
    p = Side("p", device, size)
    d = _DChild(device, size)
    rows = []
    try:
        p.fill(SEED)
        d_name, d_md, d_addr, d_dev = d.call("info")
        p_name, p_md, p_addr, p_dev = p.info()
        p.load(d_md)
        d.call("load", metadata=p_md)
        for case in cases:
            # P's first blocks, landing scattered over D's buffer (twice as big) or contiguous at 0.
            lay = layout(case, size, rng)
            src, dst = [int(i) for i in lay.src_idx], [int(i) for i in lay.dst_idx]
            # push: P writes into D, notification attached; D checks only after the notification arrived.
            d.call("zero")
            p.transfer(
                "WRITE", d_name, (d_addr, d_dev), case.block, src, dst, f"gpu-check {case.name}".encode()
            )
            d.call_pumping(p, "wait_notif", sender=p_name, timeout_s=NOTIF_WAIT_S)
            check = d.call("compare", block=case.block, seed=SEED, src_idx=src, dst_idx=dst)
            args = ("WRITE", d_name, (d_addr, d_dev), case.block, src, dst, reps)
            rows.append(_row(case, "push", check, p.time_kvwire(*args), p.time_raw(*args)))
            # pull: D reads P's blocks into its own.
            d.call("zero")
            kw = dict(op="READ", peer=p_name, remote=(p_addr, p_dev), block=case.block, local_idx=dst,
                      remote_idx=src)  # fmt: skip
            d.call_pumping(p, "transfer", **kw)
            check = d.call("compare", block=case.block, seed=SEED, src_idx=src, dst_idx=dst)
            kv_s = d.call_pumping(p, "time_kvwire", reps=reps, **kw)
            raw_s = d.call_pumping(p, "time_raw", reps=reps, **kw)
            rows.append(_row(case, "pull", check, kv_s, raw_s))
    finally:
        d.close()
        p.close()
    return rows


def _environment(device: str) -> dict[str, Any]:
    env: dict[str, Any] = {"device": device}
    for dist in ("nixl-cu13", "nixl-cu12", "nixl"):
        try:
            env["nixl"] = f"{dist}=={metadata.version(dist)}"
            break
        except metadata.PackageNotFoundError:
            continue
    env["ucx"] = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    if device == "cuda":
        import torch

        env["gpu"] = torch.cuda.get_device_name(0)
        env["torch"] = torch.__version__
        env["cuda"] = torch.version.cuda
    return env


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="where the buffers live (auto: cuda when torch sees a GPU)")  # fmt: skip
    parser.add_argument("--reps", type=int, default=5, help="timed runs per case (median reported)")
    parser.add_argument("--small", action="store_true", help="tiny sizes, for smoke tests")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")


def run(args: argparse.Namespace) -> int:
    device = pick_device(args.device)
    cases = SMALL_CASES if args.small else (CUDA_CASES if device == "cuda" else CPU_CASES)
    t0 = time.monotonic()
    rows = run_check(device, cases, args.reps)
    bad = [r for r in rows if r["bad_blocks"] or r["dirty_untouched_blocks"]]
    columns = ("case", "op", "bytes", "kvwire GB/s", "raw NIXL GB/s", "x raw", "blocks checked", "bad")
    keys = (
        "case",
        "op",
        "bytes",
        "kvwire_gbps",
        "raw_nixl_gbps",
        "ratio_vs_raw",
        "checked_blocks",
        "bad_blocks",
    )
    print_table(f"gpu-check on {device}: two processes, every byte compared, median of {args.reps}", columns,
                [tuple(r[k] for k in keys) for r in rows])  # fmt: skip
    doc = envelope("gpu-check", rows)
    doc.update(environment=_environment(device), ok=not bad, seconds=time.monotonic() - t0)
    if args.json:
        write_json(args.json, doc)
    print(f"gpu-check: {'FAILED' if bad else 'ok'} ({len(rows)} transfers checked on {device})")
    return 1 if bad else 0
