"""Typed errors for users: each names the input, the field, the numbers and the fix.

The CLI catches :class:`CoplanError` and prints its message without a traceback; anything else
escaping to the CLI is a bug in coplan, not in the user's input.
"""

from __future__ import annotations


class CoplanError(Exception):
    """Base of every error a user can cause. ``exit_code`` is what the CLI returns."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class SpecError(CoplanError):
    """A topology, workload, plan, calibration or run file is malformed.

    ``issues`` holds one ``(field_path, reason)`` pair per problem so callers and tests can inspect
    them; the message renders them all, prefixed with the file.
    """

    def __init__(self, source: str, issues: list[tuple[str, str]]) -> None:
        self.source = source
        self.issues = list(issues)
        lines = [f"{source}: invalid ({len(self.issues)} problem{'s' if len(self.issues) != 1 else ''})"]
        for path, reason in self.issues:
            lines.append(f"  - {path or '<root>'}: {reason}")
        super().__init__("\n".join(lines))


class PresetNotFoundError(CoplanError):
    """A name is neither a preset nor an existing file."""


class AmbiguousNameError(CoplanError):
    """A bare name that is both a preset and a file in the current directory: coplan will not guess which."""


class MismatchError(CoplanError):
    """A plan, calibration or run does not match the topology, world size or schema it is used with."""


class BatchError(CoplanError):
    """The workload's batch cannot be run as asked: a global batch that does not split evenly over the
    GPUs, or micro-batches that do not split the local batch. The message names the nearest batches
    (and GPU counts) that do."""


class InfeasibleError(CoplanError):
    """No plan fits: ``shortfalls`` says which resource falls short on which ranks and by how much."""

    exit_code = 3

    def __init__(self, message: str, shortfalls: list[dict] | None = None, fixes: list[str] | None = None) -> None:
        self.shortfalls = shortfalls or []
        self.fixes = fixes or []
        super().__init__(message)


class PriceRangeError(CoplanError):
    """A priced time or memory is not a finite number, or beyond what the planner's integer (CP-SAT) model holds:
    the inputs' figures, each within its plausible range, are absurd together. The message names the mesh
    candidate, the price and the limit."""


class NotLandedError(CoplanError):
    """A CLI verb whose part of coplan is not built yet. Says so instead of pretending."""

    exit_code = 4
