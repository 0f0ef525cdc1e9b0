"""Shared base of every spec: frozen, no unknown keys, a docstring on every field, units in names."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

SCHEMA_VERSION = 1
"""Bumped whenever a spec changes incompatibly; files carry it as ``schema_version``."""

Dtype = Literal["fp32", "tf32", "bf16", "fp16", "fp8"]
"""Numeric formats the cost model prices; ``fp8`` means e4m3/e5m2 with scaling."""

Collective = Literal["all_gather", "reduce_scatter", "all_reduce", "all_to_all", "p2p"]
"""Collectives the communication model prices."""

COLLECTIVES: tuple[str, ...] = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "p2p")

OpClass = Literal["gemm", "attention", "embedding", "elementwise", "collective"]
"""The one enumeration of op classes shared by cost model, trainer traces and calibration."""

OP_CLASSES: tuple[str, ...] = ("gemm", "attention", "embedding", "elementwise", "collective")


class Spec(BaseModel):
    """Base of all coplan specs."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
        str_strip_whitespace=True,
        allow_inf_nan=False,
    )


def field_error(path: str, message: str) -> ValueError:
    """An error raised by a model validator that belongs to a field: the loader moves it there.

    ``path`` is relative to the model being validated, e.g. ``tiers[1].gpus_per_nic``.
    """
    return ValueError(f"@{path}@ {message}")


def check_schema_version(v: int, hint: str = "") -> int:
    """The ``schema_version`` validator every top-level spec shares."""
    if v != SCHEMA_VERSION:
        raise ValueError(f"schema_version {v} is not supported by this coplan (expects {SCHEMA_VERSION}){hint}")
    return v
