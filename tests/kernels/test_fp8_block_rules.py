"""When the block-wise recipe may hand a GEMM to ``torch._scaled_mm``'s block-wise path (cuBLAS):
:func:`coplan.kernels.fp8.scaled_mm_block_refusal` against what the H200 did (torch 2.11.0+cu130,
2026-11-29: ``benchmarks/fp8_h200.py`` and ``tests/kernels/test_fp8.py`` on the GPU), and the recipe
asking for the Triton GEMM exactly where the rule refuses."""

from __future__ import annotations

import pytest
import torch

from coplan.kernels import fp8 as f8
from coplan.kernels import fp8_triton as ft
from coplan.kernels.fp8 import fp8_linear, scaled_mm_block_refusal

from .conftest import DEVICE

# (A rows, K, B rows as handed over (weights padded to 16), b_square) -> what cuBLAS did on the H200
OBSERVED = [
    # forward (B = W in 128x128 blocks), benchmark shapes M x K x N
    ((61000, 1024, 4096, True), "right"),
    ((61000, 4096, 1024, True), "right"),
    ((61000, 1216, 1024, True), "wrong"),   # rel. error 4e5
    ((64, 256, 1024, True), "wrong"),       # 3e4
    ((64, 256, 16, True), "right"),         # N = 1: one block row
    ((64, 512, 256, True), "right"),
    ((8192, 8192, 8192, True), "right"),    # the ceiling
    # input gradients (B = Wᵀ: rows K, contraction N)
    ((2048, 128, 1024, True), "wrong"),     # N = 8: inf
    ((64, 256, 512, True), "wrong"),        # N = 256: 12.6
    ((64, 128, 256, True), "wrong"),        # N = 1: 0.38
    ((61000, 4096, 1024, True), "right"),
    # weight gradients (1x128 x 1x128: rows N and K padded to 16, contraction the tokens)
    ((4096, 61056, 1024, False), "right"),
    ((16, 2048, 1024, False), "right"),
    # tests/kernels/test_fp8.py on the GPU
    ((200, 384, 256, True), "wrong"),       # test_block_mm_through_scaled_mm_matches_reference: 251
    ((200, 384, 256, False), "right"),
    ((50, 256, 80, True), "refused"),       # CUBLAS_STATUS_NOT_SUPPORTED (M = 50, 21, 130, 10)
    ((21, 128, 32, True), "refused"),
    ((130, 256, 128, True), "refused"),
    ((10, 128, 48, True), "refused"),
    ((40, 256, 160, True), "wrong"),        # test_kernels_agree_with_emulation's input gradient: inf
]


@pytest.mark.parametrize(("shape", "outcome"), OBSERVED, ids=[f"{s}-{o}" for s, o in OBSERVED])
def test_rule_matches_the_h200(shape, outcome):
    why = scaled_mm_block_refusal(*shape)
    assert (why is None) == (outcome == "right"), why
    if outcome == "wrong" and shape[3]:
        assert "leading dimension" in why and "K blocks" in why
    if outcome == "refused":
        assert "multiple of 4" in why


def test_the_recipe_asks_for_cublas_only_where_the_rule_allows(monkeypatch):
    """The block-wise op's three GEMMs (forward, input and weight gradients) each pass
    ``use_scaled_mm`` as the rule says for their operands (the GEMMs still run, on the test device)."""
    calls = []
    real = ft.block_mm

    def spy(qa, sa, qb, sb, *, n, b_square, out_dtype, use_scaled_mm=True):
        calls.append((tuple(qa.shape), tuple(qb.shape), b_square, use_scaled_mm))
        return real(qa, sa, qb, sb, n=n, b_square=b_square, out_dtype=out_dtype, use_scaled_mm=use_scaled_mm)

    monkeypatch.setattr(ft, "block_mm", spy)
    g = torch.Generator().manual_seed(0)
    for M, K, N in ((50, 200, 70), (64, 512, 256), (64, 640, 16)):
        calls.clear()
        x = torch.randn(M, K, generator=g).to(DEVICE).requires_grad_()
        w = torch.randn(N, K, generator=g).to(DEVICE).requires_grad_()
        fp8_linear(x, w, None, "blockwise", backend="kernels").sum().backward()
        assert len(calls) == 3
        for qa, qb, sq, used in calls:
            assert used == (scaled_mm_block_refusal(qa[0], qa[1], qb[0], sq) is None), (M, K, N, qa, qb, sq)
        fwd, dx, dw = calls
        assert fwd[3] == (M % 4 == 0 and (-(-K // 128) % 4 == 0 or N <= 128))
    assert f8.scaled_mm_block_refusal(64, 512, 4096, True) is None
