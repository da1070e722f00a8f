"""The connector asks Linux for AMX tile state in each CPU worker (integrations/vllm/cpu_tiles.py): in a fresh
process the permission is absent, after asking it is there exactly when the machine offers tiles, and asking
twice is harmless. The whole-engine proof is tests/vllm (without it a decode worker died of SIGILL)."""

from __future__ import annotations

import subprocess
import sys

from kvwire.integrations.vllm.cpu_tiles import TilePermission

_CODE = """
import ctypes
from kvwire.integrations.vllm import cpu_tiles as t
supp = ctypes.c_uint64(0)
t._arch_prctl(t._ARCH_GET_XCOMP_SUPP, supp) if t._applicable() else None
offered = bool(supp.value >> t._XFEATURE_XTILEDATA & 1)
print(t.tile_permission().value, t.allow_amx_tiles().value, t.tile_permission().value,
      t.allow_amx_tiles().value, offered)
"""


def test_a_fresh_process_gets_tile_state_exactly_when_the_machine_offers_it() -> None:
    out = subprocess.run([sys.executable, "-c", _CODE], capture_output=True, text=True, check=True).stdout
    before, asked, after, again, offered = out.split()
    if before == TilePermission.NOT_APPLICABLE.value:  # not Linux x86-64: nothing asked, nothing granted
        assert {asked, after, again} == {TilePermission.NOT_APPLICABLE.value}
        return
    assert before == TilePermission.NO_AMX.value  # nothing in a bare interpreter asked for tiles
    want = TilePermission.GRANTED if offered == "True" else TilePermission.NO_AMX
    assert (asked, after, again) == (want.value, want.value, want.value)
