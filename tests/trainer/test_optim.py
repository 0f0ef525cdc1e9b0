"""The data-parallel tables' optimizer is FBGEMM's fused row-wise Adagrad, in dense form."""

import copy

import pytest
import torch

from coplan.trainer.optim import RowWiseAdagrad


def test_rowwise_adagrad_matches_fbgemm_fused():
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen

    rows, dim, lr = 50, 8, 0.05
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=lr, eps=1e-8, pooling_mode=PoolingMode.SUM,
    )
    g = torch.Generator().manual_seed(0)
    init = torch.rand(rows, dim, generator=g) - 0.5
    tbe.split_embedding_weights()[0].copy_(init)
    weight = torch.nn.Parameter(init.clone())
    opt = RowWiseAdagrad([weight], lr=lr)
    for step in range(4):
        idx = torch.randint(0, 12, (20,), generator=g)  # rows 12.. never move
        offsets = torch.tensor([0, 3, 3, 9, 14, 20])
        up = torch.randn(5, dim, generator=g)
        tbe(idx, offsets).backward(up)
        out = torch.nn.functional.embedding_bag(idx, weight, offsets[:-1], mode="sum", include_last_offset=False)
        out.backward(up)
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(weight.detach(), tbe.split_embedding_weights()[0], rtol=1e-5, atol=1e-6)
    assert torch.equal(weight.detach()[12:], init[12:])


def _fsdp_model(seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    mesh = init_device_mesh("cpu", (1,))
    fully_shard(m[0], mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1),
    lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
], ids=["adamw", "adagrad", "sgd-momentum"])
def test_local_stepper_matches_the_dtensor_optimizer(one_rank_group, make):
    """Stepping the DTensors' local shards is the DTensor optimizer's update, bit for bit, and the DTensor
    optimizer's state (what checkpoints save) follows it."""
    from torch.distributed.tensor import DTensor

    from coplan.trainer.optim import LocalStepper

    a, b = _fsdp_model(0), _fsdp_model(0)
    assert all(isinstance(p, DTensor) for p in a.parameters())
    opt_a, opt_b = make(list(a.parameters())), make(list(b.parameters()))
    stepper = LocalStepper(opt_b)
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        x = torch.randn(8, 6, generator=g)
        for m, step in ((a, opt_a.step), (b, stepper.step)):
            m(x).square().sum().backward()
            step()
        opt_a.zero_grad(set_to_none=True)
        opt_b.zero_grad(set_to_none=True)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa.full_tensor(), pb.full_tensor())
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        assert sa.keys() == sb.keys()
        for k in sa:
            va, vb = sa[k], sb[k]
            va = va.full_tensor() if isinstance(va, DTensor) else va
            vb = vb.full_tensor() if isinstance(vb, DTensor) else vb
            assert torch.equal(torch.as_tensor(va), torch.as_tensor(vb)), k
    assert stepper._twin is not None  # the local path ran (the first step alone goes through DTensor)


def _opt_plan(dense: str = "adamw"):
    """What ``Optimizers`` reads of a plan (its workload's optimizer), without the planner (no OR-Tools on the
    GPU machine)."""
    from types import SimpleNamespace

    from coplan.spec import load_workload

    w = load_workload("gem-tiny")
    return SimpleNamespace(workload=w.model_copy(update={"optimizer": w.optimizer.model_copy(update={"dense": dense})}))


def test_the_graphed_step_is_only_asked_for_cuda_parameters():
    from coplan.trainer.optim import Optimizers

    dense = torch.nn.Linear(4, 3)
    assert not Optimizers(dense, [], None, _opt_plan(), graph_step=True).graph_step  # CPU parameters
    assert Optimizers(dense, [], None, _opt_plan(), graph_step=True).graph_note() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dense_opt", ["adamw", "adam"])
def test_the_graphed_dense_step_is_the_eager_step_on_the_gpu(dense_opt):
    """Fixed gradient buffers (as the one-GPU graphs keep them), new values each step: the graphed optimizer's
    weights follow an eager fused optimizer's; a profiled (eager) step in between keeps them together; moved
    gradients make it step eagerly and say so."""
    from coplan.trainer.optim import Optimizers

    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8)).cuda()
    b = copy.deepcopy(a)
    graphed = Optimizers(a, [], None, _opt_plan(dense_opt), fused_dense=True, graph_step=True)
    plain = Optimizers(b, [], None, _opt_plan(dense_opt), fused_dense=True)
    assert graphed.graph_step and not plain.graph_step
    bufs = [torch.zeros_like(p) for p in a.parameters()]
    g = torch.Generator(device="cuda").manual_seed(1)
    for step in range(8):
        for buf, pa, pb in zip(bufs, a.parameters(), b.parameters()):
            buf.copy_(torch.randn(buf.shape, device="cuda", generator=g))
            pa.grad, pb.grad = buf, buf.clone()
        graphed.step(eager=step == 4)
        plain.step()
        graphed.zero_grad()
        plain.zero_grad()
        for pa, pb in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)
    assert "as a CUDA graph (6 replays)" in graphed.graph_note()
    for pa, pb in zip(a.parameters(), b.parameters()):  # gradients in new tensors: eager from here on
        pa.grad, pb.grad = torch.ones_like(pa), torch.ones_like(pb)
    graphed.step()
    plain.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)
    assert "eager after 6 graph replay(s): the gradients" in graphed.graph_note()
