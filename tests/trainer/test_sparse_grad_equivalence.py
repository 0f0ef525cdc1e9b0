"""What the sharded sparse path relies on, and why row-wise Adagrad shows what SGD hides
(evidence for the drift in tests/integration/test_train_gloo.py, whose module docstring has the numbers).

1. The dense arch's gradient with respect to its *inputs* (the embedding lookups) is per sample: a
   sample's input gradient is the same whether the sample is in the whole batch or in one rank's part
   of it (each part's loss being its share of the global mean). TorchRec sends each rank's lookup
   gradients back to the tables, so this is what makes the tables' gradients match one process.
2. Row-wise Adagrad normalises each row's step by that row's own gradient scale: a row that one
   sample touches moves by about ``lr`` whatever the gradient's size, so a few-percent change in that
   sample's gradient (a ReLU at its kink flipping under fp32 rounding) moves the row by a few percent
   of ``lr``, where SGD moves it by a few percent of ``lr · |g|`` (|g| ~ 1e-3 for a per-sample share
   of a mean loss).
"""

import numpy as np
import torch

from coplan.spec import load_workload
from coplan.trainer.features import feature_layout
from coplan.trainer.model.gem import DenseArch, bce_loss_sum
from coplan.trainer.optim import RowWiseAdagrad


def _inputs(lay, b: int, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    widths = [f.table.dim for f in lay.pooled]
    lengths = torch.randint(0, 50, (b,), generator=g).tolist()
    lengths[1] = 0  # an empty history on one part
    pooled = torch.randn(b, sum(widths), generator=g)
    seq = {t.name: torch.randn(sum(lengths), t.dim, generator=g) for s in lay.sequences for t in lay.sequence_tables[s]}
    dense = torch.randn(b, lay.num_dense, generator=g)
    labels = (torch.rand(b, len(lay.tasks), generator=g) > 0.5).float()
    return lengths, pooled, seq, dense, labels


def test_dense_input_gradients_are_per_sample():
    w = load_workload("gem-tiny")
    lay = feature_layout(w)
    keys, widths = tuple(lay.pooled_names), [f.table.dim for f in lay.pooled]
    torch.manual_seed(0)
    arch = DenseArch(w, lay, "reference")
    b = 12
    lengths, pooled, seq, dense, labels = _inputs(lay, b)
    offs = np.concatenate([[0], np.cumsum(lengths)])

    def input_grads(idx):
        rows = torch.from_numpy(np.concatenate([np.arange(offs[i], offs[i + 1]) for i in idx]).astype(np.int64))
        sub = torch.tensor(np.concatenate([[0], np.cumsum([lengths[i] for i in idx])]), dtype=torch.int64)
        p = pooled[idx].clone().requires_grad_()
        s = {k: v[rows].clone().requires_grad_() for k, v in seq.items()}
        out = arch(p, keys, widths, s, {q: sub for q in lay.sequences}, dense[idx])
        (bce_loss_sum(out.float(), labels[idx]) / b).backward()  # this part's share of the whole batch's mean
        return p.grad, {k: v.grad for k, v in s.items()}, rows

    whole_p, whole_s, _ = input_grads(list(range(b)))
    # an uneven split, samples out of order: what the balancer hands two ranks
    for idx in ([7, 0, 3, 1, 10], [2, 4, 5, 6, 8, 9, 11]):
        p, s, rows = input_grads(idx)
        torch.testing.assert_close(p, whole_p[idx], rtol=1e-4, atol=1e-7)
        for k in s:
            torch.testing.assert_close(s[k], whole_s[k][rows], rtol=1e-4, atol=1e-7)


def test_rowwise_adagrad_step_ignores_gradient_scale_unlike_sgd():
    lr, dim = 0.05, 16
    g = torch.Generator().manual_seed(0)
    grad = 1e-3 * torch.randn(1, dim, generator=g)  # one row, touched by one sample
    other = grad.clone()
    other[0, 2] *= 0.0  # the same sample with one hidden unit's contribution gone (a flipped ReLU)

    def moved(opt_cls, gr, **kw):
        w = torch.nn.Parameter(torch.zeros(1, dim))
        opt = opt_cls([w], lr=lr, **kw)
        w.grad = gr.clone()
        opt.step()
        return w.detach().clone()

    ada = (moved(RowWiseAdagrad, grad) - moved(RowWiseAdagrad, other)).abs().max().item()
    sgd = (moved(torch.optim.SGD, grad) - moved(torch.optim.SGD, other)).abs().max().item()
    # Adagrad: the step is lr·g/rms(g), of order lr whatever |g| is; SGD: of order lr·|g|
    torch.testing.assert_close(moved(RowWiseAdagrad, grad), moved(RowWiseAdagrad, grad * 1e3), rtol=1e-4, atol=0)
    assert ada > 100 * sgd, (ada, sgd)
    assert ada > 1e-3 * lr
