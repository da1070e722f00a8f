"""Linux lends a process the AMX tile registers only after it asks (``arch_prctl(ARCH_REQ_XCOMP_PERM)``,
Linux >= 5.16); a tile instruction in a process that has not asked dies of SIGILL. vLLM's CPU attention
(``cpu_attn_amx.hpp``, vLLM 0.32) runs tile instructions without asking, and so relies on oneDNN (which asks)
having run an AMX kernel first. Measured on a Sapphire Rapids VM: colocated and prefill engines answer, while
a decode engine's first step after a remote prefill (one query token over a transferred context) reaches the
tile kernel first and the worker dies on the first request. The connector asks in each CPU worker before any
step; asking again, or on a machine without AMX, changes nothing."""

from __future__ import annotations

import ctypes
import enum
import platform
import sys

_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_GET_XCOMP_SUPP = 0x1021
_ARCH_GET_XCOMP_PERM = 0x1022
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


class TilePermission(enum.Enum):
    GRANTED = "granted"  # the process may run AMX tile instructions
    NO_AMX = "no_amx"  # the kernel offers no tile state on this machine: nothing to ask for
    NOT_APPLICABLE = "not_applicable"  # not Linux on x86-64


def _arch_prctl(code: int, arg: int | ctypes.c_uint64) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    ref = ctypes.byref(arg) if isinstance(arg, ctypes.c_uint64) else ctypes.c_ulong(arg)
    return int(libc.syscall(_SYS_ARCH_PRCTL, code, ref))


def _has_tiledata(code: int) -> bool:
    mask = ctypes.c_uint64(0)
    return _arch_prctl(code, mask) == 0 and bool(mask.value >> _XFEATURE_XTILEDATA & 1)


def tile_permission() -> TilePermission:
    """Whether this process may already run tile instructions (asks nothing)."""
    if not _applicable():
        return TilePermission.NOT_APPLICABLE
    return TilePermission.GRANTED if _has_tiledata(_ARCH_GET_XCOMP_PERM) else TilePermission.NO_AMX


def allow_amx_tiles() -> TilePermission:
    """Ask the kernel for AMX tile state for this process when the machine offers it."""
    if not _applicable():
        return TilePermission.NOT_APPLICABLE
    if not _has_tiledata(_ARCH_GET_XCOMP_SUPP):
        return TilePermission.NO_AMX
    if _arch_prctl(_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
        return TilePermission.NO_AMX  # offered but refused (a seccomp filter, a sigaltstack too small)
    return TilePermission.GRANTED


def _applicable() -> bool:
    return sys.platform == "linux" and platform.machine() == "x86_64"
