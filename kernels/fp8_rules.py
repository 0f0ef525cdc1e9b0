"""Which block-scaled GEMMs cuBLAS's block-wise ``torch._scaled_mm`` computes right (no Triton, no torch
import needed): shared by the recipe (:mod:`.fp8`) and the GEMM wrapper (:mod:`.fp8_triton`)."""

from __future__ import annotations


def scaled_mm_block_refusal(a_rows: int, k: int, b_rows: int, b_square: bool) -> str | None:
    """None where ``torch._scaled_mm``'s block-wise path (cuBLAS) computes ``qa @ qbᵀ`` right for an
    ``a [a_rows, k]`` in 1x128 tiles and a ``b [b_rows, k]`` in 128x128 blocks (``b_square``) or 1x128
    tiles, with the scale layouts :mod:`.fp8_triton` hands over; else why not (the recipe then takes
    the Triton block GEMM). The rules, from the H200 runs of 2026-11-29 (torch 2.11.0+cu130):

    * **128x128 B**: cuBLAS reads B's block scales K-block-major with a leading dimension of
      ``round_up(ceil(k/128), 4)`` (the cuBLAS docs' L4; PyTorch's own tests pad the scales so),
      while the legacy ``torch._scaled_mm`` accepts only the unpadded contiguous
      ``[ceil(b_rows/128), ceil(k/128)]``. The two agree only when ``ceil(k/128)`` is a multiple
      of 4 or B has a single block row; otherwise every block row after the first reads another
      row's scales: silently wrong output (forward at 61000x1216x1024: error 4e5; 64x256x1024: 3e4;
      the input gradients with N = 8, 256: inf, 12.6), the first 128 columns right.
    * **1x128 A or B**: its scales are stored row-major-outer (``[rows, k/128]``, strides
      ``(1, rows)``); cuBLAS refuses (``CUBLAS_STATUS_NOT_SUPPORTED`` from
      ``cublasLtMatmulAlgoGetHeuristic``) rows that are not a multiple of 4, which leaves that
      leading dimension short of 16 bytes: it failed at 10, 21, 50 and 130 token rows and ran at 40,
      64, 200, 512, 2048, 2688 and 61000. (Inferred from which shapes failed, not from a document.)
    """
    kb = -(-k // 128)
    if a_rows % 4:
        return f"A's {a_rows} rows are not a multiple of 4 (its 1x128 scales' leading dimension): cuBLAS refuses it"
    if b_square:
        if kb % 4 and -(-b_rows // 128) > 1:
            return (f"B's 128x128 scales have {kb} K blocks, not a multiple of 4: cuBLAS reads them with a leading "
                    f"dimension of {-(-kb // 4) * 4} where torch._scaled_mm passes {kb} (wrong output)")
    elif b_rows % 4:
        return f"B's {b_rows} rows are not a multiple of 4 (its 1x128 scales' leading dimension): cuBLAS refuses it"
    return None


__all__ = ["scaled_mm_block_refusal"]
