"""Rounding helpers that emulate 16-bit GPU arithmetic on top of float64 numpy.

The stand-in computes in float64 and rounds at the points where a real kernel stores a
narrower value. Because float64 carries far more precision than any stored format, the
rounded results do not depend on BLAS threading or contraction order, so the same request
from the same cache state yields the same bytes on any machine.

Two array kinds are used: float64 arrays holding values already representable in the
target format ("rounded float64"), and float32 arrays for quantities a kernel keeps in fp32
(scores, exponentials, row sums, log-sum-exp). IEEE float32 add/sub/mul/div are correctly
rounded, so doing those natively in float32 is exactly "compute, then round to fp32".
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable
from typing import Literal

import numpy as np
from numpy.typing import NDArray

F64 = NDArray[np.float64]
F32 = NDArray[np.float32]
Format = Literal["bf16", "fp16", "fp32", "none"]

INT4_GROUP = 32
_INT4_MAX = 7  # symmetric: the code -8 is left unused so that +/- ranges match


# 0-d arrays rather than Python ints: numpy resolves same-dtype operands much faster, and
# the per-call overhead dominates on the small arrays of a decode step.
_SHIFT = np.array(16, dtype=np.uint32)
_ONE = np.array(1, dtype=np.uint32)
_HALF = np.array(0x7FFF, dtype=np.uint32)
_UPPER = np.array(0xFFFF0000, dtype=np.uint32)


def _bf16_inplace(x: F32) -> F32:
    bits = x.view(np.uint32)
    # Adding 0x7FFF plus the lowest kept bit rounds half to even on the upper 16 bits.
    lsb = bits >> _SHIFT
    lsb &= _ONE
    lsb += _HALF
    bits += lsb
    bits &= _UPPER
    return x


def bf16_f32(x: F32) -> F32:
    """Round a float32 array to bfloat16 (round-to-nearest-even), returned as float32."""
    return _bf16_inplace(x.copy())


def fmt_f32(x: F32, fmt: Format, *, owned: bool = False) -> F32:
    """Round a float32 array to `fmt`, keeping float32 storage (in place if `owned`)."""
    if fmt == "bf16":
        return _bf16_inplace(x if owned else x.copy())
    if fmt == "fp16":
        return x.astype(np.float16).astype(np.float32)
    return x


def to_f32(x: F64) -> F32:
    """Round float64 values to float32 (the accumulator format of real kernels)."""
    return x.astype(np.float32)


def round_bf16(x: F64) -> F64:
    """float64 -> float32 -> bf16 (nearest-even on the upper 16 bits), as float64."""
    return _bf16_inplace(x.astype(np.float32)).astype(np.float64)


def round_fp16(x: F64) -> F64:
    """float64 -> float16 (nearest-even), as float64."""
    return x.astype(np.float16).astype(np.float64)


def round_fp32(x: F64) -> F64:
    """float64 -> float32, as float64."""
    return x.astype(np.float32).astype(np.float64)


def round_none(x: F64) -> F64:
    """Identity: no rounding (useful to show that rounding is what makes reruns diverge)."""
    return x


_ROUNDERS: dict[str, Callable[[F64], F64]] = {
    "bf16": round_bf16,
    "fp16": round_fp16,
    "fp32": round_fp32,
    "none": round_none,
}


def rounder(fmt: Format) -> Callable[[F64], F64]:
    """The float64 -> float64 rounding function for a storage format."""
    return _ROUNDERS[fmt]


def quantize_int4(w: F64) -> tuple[NDArray[np.int8], F64]:
    """Symmetric group-wise int4 of a [fan_in, fan_out] matrix, groups of 32 along fan_in.

    Returns the codes (int8 in -7..7, same shape as `w`) and one scale per group and output
    column, shape [fan_in // 32, fan_out].
    """
    fan_in, fan_out = w.shape
    if fan_in % INT4_GROUP:
        raise ValueError(f"fan_in {fan_in} is not a multiple of {INT4_GROUP}")
    groups = w.reshape(fan_in // INT4_GROUP, INT4_GROUP, fan_out)
    scale = np.abs(groups).max(axis=1) / _INT4_MAX
    safe = np.where(scale > 0, scale, 1.0)
    codes = np.clip(np.rint(groups / safe[:, None, :]), -_INT4_MAX, _INT4_MAX)
    return codes.reshape(fan_in, fan_out).astype(np.int8), scale


def dequantize_int4(codes: NDArray[np.int8], scale: F64) -> F64:
    """Inverse of `quantize_int4` (exact: codes times their group's scale)."""
    fan_in, fan_out = codes.shape
    groups = codes.reshape(fan_in // INT4_GROUP, INT4_GROUP, fan_out).astype(np.float64)
    return (groups * scale[:, None, :]).reshape(fan_in, fan_out)


def keep_freed_memory() -> None:
    """Ask glibc to keep freed heap memory instead of returning it to the OS at every free.

    A prefill allocates and frees tens of MB of numpy temporaries per layer; with glibc's
    default thresholds every reuse page-faults the memory in again, which made prefill two
    to three times slower on the reference VM. Process-wide, idempotent, and skipped where
    the C library has no mallopt.
    """
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: keep up to 1 GiB of free heap
    mallopt(-3, 1 << 28)  # M_MMAP_THRESHOLD: serve blocks below 256 MiB from the heap
