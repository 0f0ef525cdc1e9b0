"""The attention autotuner's candidates: tiles longer than the longest sample are left out (fewer compiles and
timings in a run's first step), never all of them."""

from __future__ import annotations

from coplan.kernels import triton_attention as ta


def _tiles(configs):
    return {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in configs}


def test_short_samples_drop_the_long_tiles():
    for kind in ("fwd", "dq", "dkdv"):
        for d in (64, 128, 256):
            every = ta.configs_for(kind, d)
            kept = ta.fit_lengths(every, 64, 64)  # Kunlun-like: 40 tokens, bucket 64
            assert kept and set(kept) <= set(every)
            lo_m = min(m for m, _ in _tiles(every))
            assert all(m <= max(64, lo_m) for m, _ in _tiles(kept))
            lo_n = min(n for _, n in _tiles(c for c in every if c.kwargs["BLOCK_M"] <= max(64, lo_m)))
            assert all(n <= max(64, lo_n) for _, n in _tiles(kept))
            assert len(kept) < len(every) or all(m <= 64 and n <= 64 for m, n in _tiles(every))
            assert ta.fit_lengths(every, 2048, 2048) == every  # long histories: every candidate


def test_a_bucket_below_every_tile_keeps_the_shortest():
    every = ta.configs_for("fwd", 128)
    kept = ta.fit_lengths(every, 16, 2048)  # the summary queries: 16 a sample
    shortest = min(m for m, _ in _tiles(every))
    assert kept and {m for m, _ in _tiles(kept)} == {shortest}
    assert len(kept) == sum(1 for c in every if c.kwargs["BLOCK_M"] == shortest)


def test_the_autotuners_prune_reads_the_length_buckets():
    tuned = ta._tuned("fwd", ta._fwd_kernel)
    args = {"HEAD_DIM": 128, "MAX_Q_BUCKET": 64, "MAX_K_BUCKET": 32}
    kept = tuned.early_config_prune(tuned.configs, args)
    assert _tiles(kept) == _tiles(ta.fit_lengths(ta.configs_for("fwd", 128), 64, 32))
    assert all(m <= 64 and n <= 32 for m, n in _tiles(kept))
