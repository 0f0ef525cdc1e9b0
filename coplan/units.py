"""Units, converted once at load time. Field names carry the unit (``bw_bytes_per_s``)."""

from __future__ import annotations

KB = 1e3
MB = 1e6
GB = 1e9
TB = 1e12
KiB = 1024.0
MiB = 1024.0**2
GiB = 1024.0**3
TiB = 1024.0**4

TFLOP = 1e12
PFLOP = 1e15

US = 1e-6
MS = 1e-3


def gbit_per_s_to_bytes_per_s(gbit_per_s: float) -> float:
    """Network links are sold in bits per second; coplan computes in bytes per second."""
    return gbit_per_s * 1e9 / 8.0


DTYPE_BYTES: dict[str, int] = {
    "fp32": 4,
    "tf32": 4,
    "bf16": 2,
    "fp16": 2,
    "fp8": 1,
    "int8": 1,
    "int4": 1,  # rounded up: a table of int4 rows is priced at a byte per element plus scales
}


def dtype_bytes(dtype: str) -> int:
    return DTYPE_BYTES[dtype]


def human_bytes(n: float) -> str:
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def human_seconds(s: float) -> str:
    if s >= 1.0:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"
