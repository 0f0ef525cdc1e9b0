"""The trainer with a numerical fault injected, for test_faults.py (a torchrun script:
``poisoned_trainer.py loss@K|grad@K <trainer arguments>``): at step K, rank 0's loss, or one of its
dense gradients, becomes non-finite; the trainer's guard must stop the run."""

from __future__ import annotations

import sys

from coplan.trainer import loop, train


def poison(what: str, at: int) -> None:
    """Wrap the loop's steps: the loss of step ``at`` times NaN, or its first dense gradient filled with
    Inf, on rank 0."""
    step, loss, dense_grads = loop.Loop.step, loop.Loop.loss, loop.Loop.dense_grads
    current = {"step": -1}

    def poisoned_step(self, k):
        current["step"] = k
        return step(self, k)

    def poisoned_loss(self, *a):
        value, parts = loss(self, *a)
        if what == "loss" and current["step"] == at and self.ranks.rank == 0:
            value = value * float("nan")
        return value, parts

    def poisoned_grads(self):
        grads = dense_grads(self)
        if what == "grad" and current["step"] == at and self.ranks.rank == 0 and grads:
            grads[0].fill_(float("inf"))
        return grads

    loop.Loop.step, loop.Loop.loss, loop.Loop.dense_grads = poisoned_step, poisoned_loss, poisoned_grads


if __name__ == "__main__":
    what, _, at = sys.argv[1].partition("@")
    if what not in ("loss", "grad") or not at.isdigit():
        raise SystemExit(f"{sys.argv[1]!r}: expected 'loss@<step>' or 'grad@<step>'")
    poison(what, int(at))
    sys.exit(train.main(sys.argv[2:]))
