"""The data-parallel tables' optimizer is FBGEMM's fused row-wise Adagrad, in dense form."""

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
