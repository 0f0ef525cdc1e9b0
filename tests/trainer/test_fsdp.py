"""FSDP2 on one rank: one unit (the dense root) computes what one unit per layer computes, in bf16
mixed precision, and only where every mesh is one rank."""

import numpy as np
import torch
from torch.distributed.device_mesh import init_device_mesh

from coplan.spec import load_workload
from coplan.trainer.distributed.fsdp import apply_fsdp, one_unit
from coplan.trainer.features import feature_layout
from coplan.trainer.model.gem import DenseArch, bce_loss_sum


def _train(per_layer: bool, steps: int = 3):
    w = load_workload("gem-tiny")
    lay = feature_layout(w)
    precision = w.precision.model_copy(update={"compute_dtype": "bf16"})
    torch.manual_seed(0)
    arch = DenseArch(w, lay, "reference")
    mesh = init_device_mesh("cpu", (1,))
    assert one_unit(mesh, mesh)
    assert apply_fsdp(arch, mesh, mesh, precision, per_layer=per_layer) is per_layer
    opt = torch.optim.AdamW(arch.parameters(), lr=w.optimizer.dense_lr)
    g = torch.Generator().manual_seed(1)
    keys, widths = tuple(lay.pooled_names), [f.table.dim for f in lay.pooled]
    b, losses = 8, []
    for _ in range(steps):
        lengths = torch.randint(1, 20, (b,), generator=g)
        offs = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        seq = {t.name: torch.randn(int(offs[-1]), t.dim, generator=g) for s in lay.sequences for t in lay.sequence_tables[s]}
        out = arch(torch.randn(b, sum(widths), generator=g), keys, widths, seq, {s: offs for s in lay.sequences},
                   torch.randn(b, lay.num_dense, generator=g))
        assert out.dtype == torch.bfloat16  # mixed precision is on
        loss = bce_loss_sum(out.float(), (torch.rand(b, len(lay.tasks), generator=g) > 0.5).float()) / b
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return np.array(losses), [p.full_tensor().clone() for p in arch.parameters()]


def test_one_unit_matches_one_unit_per_layer_on_one_rank(one_rank_group):
    (la, pa), (lb, pb) = _train(True), _train(False)
    assert la[-1] != la[0]
    np.testing.assert_array_equal(la, lb)
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
