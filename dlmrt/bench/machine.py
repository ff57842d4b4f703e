"""The CPU a speed figure was measured on, and the class of CPUs whose speed ratios are comparable.

A speed ratio between two CPU loops is not a property of the code alone: on an AVX-512 EPYC the
eager step ran 2.10x the reference loop, and on CI's machine (the same suite and tree) 1.44-1.49x,
with the reference 30% faster there against a fixed GEMM. So the gate keeps its timings
per machine class: the architecture, the vendor, the vector ISA torch's kernels dispatch to, and
whether the CPU advertises AMX.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class CpuInfo:
    model: str
    vendor: str
    flags: frozenset[str]


def cpu_info(cpuinfo: Path = CPUINFO) -> CpuInfo:
    """The first processor's model name, vendor and flags (empty where /proc/cpuinfo is absent)."""
    model, vendor, flags = platform.processor() or platform.machine(), "unknown", frozenset()
    if cpuinfo.is_file():
        fields: dict[str, str] = {}
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
        model = fields.get("model name", model)
        vendor = fields.get("vendor_id", vendor)
        flags = frozenset(fields.get("flags", "").split())
    return CpuInfo(model, vendor, flags)


def machine_class(info: CpuInfo | None = None) -> str:
    """e.g. "x86_64 AuthenticAMD AVX512" or "x86_64 GenuineIntel AVX512 AMX"."""
    import torch

    info = cpu_info() if info is None else info
    parts = [platform.machine(), info.vendor, torch.backends.cpu.get_cpu_capability()]
    if "amx_tile" in info.flags:
        parts.append("AMX")
    return " ".join(parts)
