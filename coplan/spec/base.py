"""Shared base of every spec: frozen, no unknown keys, a docstring on every field, units in names."""

from __future__ import annotations

import math
import numbers
from typing import Annotated, Literal

import numpy as np
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Strict

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


INT64_MAX = 2**63 - 1
"""Largest count any spec field holds: torch, numpy and FBGEMM index with int64."""


def _real(v: object) -> object:
    # pydantic's lax mode reads true as 1.0 and "1e9" as 1e9: a bandwidth of 1 B/s from `bw: true`.
    if isinstance(v, (bool, np.bool_)):
        raise ValueError("must be a number, not a boolean (true/false)")
    if isinstance(v, numbers.Real) and not isinstance(v, (int, float)):
        return float(v)
    return v


def _whole(v: object) -> object:
    if isinstance(v, (bool, np.bool_)):
        raise ValueError("must be a whole number, not a boolean (true/false)")
    if isinstance(v, numbers.Integral) and not isinstance(v, int):
        v = int(v)
    elif isinstance(v, numbers.Real) and not isinstance(v, int):
        f = float(v)
        # YAML writes 1e6 as a float: a whole value is taken exactly, a fractional one is never rounded
        if not math.isfinite(f) or not f.is_integer():
            raise ValueError(f"must be a whole number (a count); got {f!r}, which coplan will not round")
        v = int(f)
    if isinstance(v, int) and abs(v) > INT64_MAX:
        raise ValueError(f"{v:.3g} is beyond the 64-bit integer range every count must fit in")
    return v


Float = Annotated[float, BeforeValidator(_real), Strict()]
"""A finite real number: ints are taken, booleans and strings refused (never 1.0 for ``true``)."""

Int = Annotated[int, BeforeValidator(_whole), Strict()]
"""A count: whole numbers only (``1e6`` is taken as 1000000, ``2.5`` refused), never a boolean or string,
within int64."""

Bool = Annotated[bool, Strict()]
"""true or false only (never 1, 0 or "yes" as a string)."""


class Plausible:
    """An after-validator refusing a number outside the range any real hardware or model has, naming the unit
    and, when the value looks like a unit slip (``hbm_bytes: 141`` for 141 GB), the value meant.

    ``lo``/``hi`` are set orders of magnitude beyond real figures both ways, so that no realistic input is
    refused; they keep absurd ones (a bandwidth of 1e-6 B/s, 1e30 bytes of HBM) from reaching the cost model
    and the planner, whose integers they would overflow. ``slips``: ``(multiplier, unit)`` pairs tried in order
    on a value below ``lo``; the first whose product lands in ``typical`` is suggested."""

    def __init__(self, lo: float, hi: float, unit: str, unit_words: str, what: str, *,
                 slips: tuple[tuple[float, str], ...] = (), typical: tuple[float, float] | None = None, why: str = "") -> None:
        self.lo, self.hi, self.unit, self.unit_words, self.what, self.why = lo, hi, unit, unit_words, what, why
        self.slips, self.typical = slips, typical or (lo, hi)

    @staticmethod
    def _fmt(x: float) -> str:
        return f"{x:g}".replace("e+0", "e").replace("e+", "e").replace("e-0", "e-")

    def _slip(self, v: float) -> str:
        for mult, name in self.slips:
            if self.typical[0] <= v * mult <= self.typical[1]:
                return f"; write {v:g}e{round(math.log10(mult))} for {v:g} {name}"
        return ""

    def __call__(self, v: float) -> float:
        unit = f" {self.unit}" if self.unit else ""
        why = f"; {self.why}" if self.why else ""
        if v < self.lo:
            slip = self._slip(v)
            if slip:
                raise ValueError(f"{v:g}{unit} is implausibly small for {self.unit_words} (below any real {self.what}, "
                                 f"expect >= {self._fmt(self.lo)}){slip}{why}")
            raise ValueError(f"{v:g}{unit} is below any real {self.what} (expect >= {self._fmt(self.lo)}; values are {self.unit_words}){why}")
        if v > self.hi:
            raise ValueError(f"{v:g}{unit} is above any real {self.what} (expect <= {self._fmt(self.hi)}; values are {self.unit_words}){why}")
        return v


def plausible(lo: float, hi: float, unit: str, unit_words: str, what: str, **kw) -> AfterValidator:
    """``Annotated[Float, Field(gt=0), plausible(...)]``: see :class:`Plausible`."""
    return AfterValidator(Plausible(lo, hi, unit, unit_words, what, **kw))


FROM_FILE = "coplan_from_file"
"""Validation-context key the loader sets: the document is a file a user gave, held to what a file must
say in full (a plan file lists every table's sharding), not a spec built in Python."""


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


def drop_added_defaults(out: object, defaults: dict[str, object]) -> object:
    """A spec's serialised dict without the fields added after files of its kind were written, where they
    hold their default: content hashes of files written before a field existed stay valid (a wrap
    ``model_serializer`` of the spec calls this)."""
    if isinstance(out, dict):
        for k, d in defaults.items():
            if k in out and out[k] == d:
                out.pop(k)
    return out


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
