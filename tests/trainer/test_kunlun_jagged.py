"""Kunlun's GDPA on the jagged Triton kernel (each sample's tokens one segment of the same length): the same
outputs and gradients as the dense batched-matmul form, through the Triton interpreter on CPU; and which
attention goes which way."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from coplan.spec.workload import Attention, KunlunBlock
from coplan.trainer.model.layers import KunlunLayer, kunlun_jagged_applies

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
pytestmark = pytest.mark.skipif(not CUDA and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs a GPU or the Triton interpreter on CPU")
TOL = dict(rtol=2e-2, atol=2e-3) if CUDA else dict(rtol=1e-4, atol=1e-5)
"""(on the GPU the kernels' fp32 dots run in TF32)"""

D = 24


def _block(head_dim: int, heads: int = 2, causal: bool = False, kind: str = "gdpa", activation: str = "silu") -> KunlunBlock:
    return KunlunBlock(num_layers=1, num_tokens=5, model_dim=D, num_heads=heads, head_dim=head_dim, ffn_multiplier=2,
                       attention=Attention(kind=kind, activation=activation, causal=causal))


def _pair(block: KunlunBlock, tokens: int) -> tuple[KunlunLayer, KunlunLayer]:
    torch.manual_seed(0)
    dense = KunlunLayer("kunlun.0", block, tokens, backend="reference")
    jagged = KunlunLayer("kunlun.0", block, tokens, backend="triton")
    jagged.load_state_dict(copy.deepcopy(dense.state_dict()))
    return dense.to(DEV), jagged.to(DEV)


def _run(layer: KunlunLayer, z: torch.Tensor):
    z = z.clone().requires_grad_()
    out = layer(z)
    (out.square().mean() + out.sum() * 0.01).backward()
    return out.detach(), z.grad, {n: p.grad for n, p in layer.named_parameters()}


@pytest.mark.parametrize("head_dim,heads,tokens,causal,activation", [
    (8, 2, 6, False, "silu"),
    (12, 3, 7, True, "silu"),        # a head dim that is not a power of two; causal
    (16, 1, 40, False, "gelu_tanh"),  # tokens past one block of the kernel's smallest tile
])
def test_the_jagged_kernel_computes_the_dense_attention(head_dim, heads, tokens, causal, activation):
    block = _block(head_dim, heads, causal, activation=activation)
    dense, jagged = _pair(block, tokens)
    z = torch.randn(3, tokens, D, generator=torch.Generator().manual_seed(1)).to(DEV)
    assert kunlun_jagged_applies(jagged.attn, jagged.backend, jagged.head_dim, z)
    assert not kunlun_jagged_applies(dense.attn, dense.backend, dense.head_dim, z)
    want, got = _run(dense, z), _run(jagged, z)
    torch.testing.assert_close(got[0], want[0], **TOL)
    torch.testing.assert_close(got[1], want[1], **TOL)
    assert want[2].keys() == got[2].keys()
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], **TOL, msg=name)


def test_softmax_large_head_dims_and_other_backends_stay_dense():
    z = torch.zeros(1, 2, D, device=DEV)
    gdpa = Attention(kind="gdpa", activation="silu")
    assert kunlun_jagged_applies(gdpa, "triton", 256, z)
    assert not kunlun_jagged_applies(gdpa, "triton", 320, z)          # past the Triton kernels' head dims
    assert not kunlun_jagged_applies(Attention(kind="softmax"), "triton", 64, z)  # PyTorch's fused SDPA
    assert not kunlun_jagged_applies(gdpa, "reference", 64, z)
    assert not kunlun_jagged_applies(gdpa, "flex", 64, z)
