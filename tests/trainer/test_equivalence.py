"""Summation order alone does not make AdamW drift: evidence for tests/integration/test_train_gloo.py.

The dense arch of gem-tiny is trained twice on the same batches with AdamW, its gradient computed over
the whole batch, or summed over two half batches (what two data-parallel ranks compute). The two runs
differ only in the order of fp32 sums; were Adam's per-element normalisation to amplify that rounding,
the loss curves would separate within 20 steps. They stay at the rounding level.
"""

import numpy as np
import torch

from coplan.spec import load_workload
from coplan.trainer.features import feature_layout
from coplan.trainer.model.gem import DenseArch, bce_loss_sum

STEPS = 20


def _batches(lay, n=4, b=16):
    g = torch.Generator().manual_seed(1)
    widths = [f.table.dim for f in lay.pooled]
    teacher = torch.randn(sum(widths), generator=g)
    out = []
    for _ in range(n):
        lengths = torch.randint(0, 40, (b,), generator=g).tolist()
        pooled = torch.randn(b, sum(widths), generator=g)
        seq = {t.name: torch.randn(sum(lengths), t.dim, generator=g) for s in lay.sequences for t in lay.sequence_tables[s]}
        dense = torch.randn(b, lay.num_dense, generator=g)
        labels = ((pooled @ teacher)[:, None] + 0.5 * torch.randn(b, len(lay.tasks), generator=g) > 0).float()
        out.append((lengths, pooled, seq, dense, labels))
    return out


def _train(split: bool) -> np.ndarray:
    w = load_workload("gem-tiny")
    lay = feature_layout(w)
    keys, widths = tuple(lay.pooled_names), [f.table.dim for f in lay.pooled]
    torch.manual_seed(0)
    arch = DenseArch(w, lay, "reference")
    params = list(arch.parameters())
    opt = torch.optim.AdamW(params, lr=w.optimizer.dense_lr, weight_decay=w.optimizer.weight_decay)
    batches, curve = _batches(lay), []
    for step in range(STEPS):
        lengths, pooled, seq, dense, labels = batches[step % len(batches)]
        b = len(lengths)
        offs = np.concatenate([[0], np.cumsum(lengths)])
        parts = [list(range(b))] if not split else [list(range(b // 2)), list(range(b // 2, b))]
        total, grads = 0.0, None
        for idx in parts:
            opt.zero_grad()
            rows = torch.from_numpy(np.concatenate([np.arange(offs[i], offs[i + 1]) for i in idx]).astype(np.int64))
            sub = np.concatenate([[0], np.cumsum([lengths[i] for i in idx])])
            out = arch(pooled[idx], keys, widths, {k: v[rows] for k, v in seq.items()},
                       {s: torch.tensor(sub, dtype=torch.int64) for s in lay.sequences}, dense[idx])
            loss = bce_loss_sum(out.float(), labels[idx]) / b  # each part's share of the batch mean, as on a rank
            loss.backward()
            total += loss.item()
            gs = [p.grad.clone() for p in params]
            grads = gs if grads is None else [a + c for a, c in zip(grads, gs)]
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        curve.append(total)
    return np.array(curve)


def test_adamw_does_not_amplify_summation_order():
    whole, halves = _train(False), _train(True)
    assert whole[-4:].mean() < whole[:4].mean() - 0.1  # it trains: Adam's steps are not vanishingly small
    assert not np.array_equal(whole, halves)  # the two orders do round differently
    np.testing.assert_allclose(whole, halves, rtol=0, atol=2e-6)
