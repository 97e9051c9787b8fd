"""Which oneDNN ISA caps (`ONEDNN_MAX_CPU_ISA`) this CPU can emulate: each cap limits oneDNN to the instruction
sets of an older CPU, so one machine can check what the matmuls compute on others (docs/quality.md). oneDNN reads
the variable once per process, at its first primitive; a cap above what the CPU has changes nothing."""

from __future__ import annotations

from kvfence.model.kernels import cpu_flags as cpu_flags_line

# cap -> the /proc/cpuinfo flags it needs, lowest first (oneDNN's names; `default` is no cap)
CAPS: dict[str, frozenset[str]] = {
    "AVX2": frozenset({"avx2", "fma"}),
    "AVX512_CORE": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"}),
    "AVX512_CORE_BF16": frozenset(
        {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16"}
    ),
}


def cpu_flags() -> set[str]:
    """The CPU's instruction sets from /proc/cpuinfo (empty where there is none)."""
    line = cpu_flags_line().decode(errors="replace")
    return set(line.split(":", 1)[1].split()) if ":" in line else set()


def reachable_caps(flags: set[str] | None = None) -> list[str]:
    """The caps this CPU has every instruction set of, lowest first, then `default` (this CPU's best)."""
    have = cpu_flags() if flags is None else flags
    return [cap for cap, needs in CAPS.items() if needs <= have] + ["default"]
