"""The workload sampler: seeded, within its family's ranges, valid specs that plan on the family's target."""

from __future__ import annotations

import pytest
import yaml

from coplan.cli import main
from coplan.errors import CoplanError
from coplan.sample import FAMILIES, family_world, sample_workload
from coplan.spec import Workload
from coplan.spec.loader import load_workload

SEEDS = range(25)


def _blocks(w: Workload) -> dict:
    return {b.type: b for b in w.blocks}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_seeded_and_deterministic(family):
    a, b = sample_workload(family, 12345), sample_workload(family, 12345)
    assert a == b
    assert sample_workload(family, 12346) != a


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("seed", SEEDS)
def test_within_ranges(family, seed):
    f = FAMILIES[family]
    w = sample_workload(family, seed)
    bl = _blocks(w)
    seq = bl["interformer"]
    assert seq.head_dim in f.head_dims
    assert f.num_heads[0] <= seq.num_heads <= f.num_heads[1]
    assert seq.model_dim == seq.num_heads * seq.head_dim
    assert f.model_dim[0] <= seq.model_dim <= f.model_dim[1]
    assert f.interformer_layers[0] <= seq.num_layers <= f.interformer_layers[1]
    assert f.kunlun_layers[0] <= bl["kunlun"].num_layers <= f.kunlun_layers[1]
    assert bl["kunlun"].num_heads * bl["kunlun"].head_dim == seq.model_dim
    if seq.attention.kind == "gdpa":
        assert seq.attention.activation in f.gdpa_activations
    length = w.sequences[0].length
    assert f.history_mean[0] - 0.1 <= length.mean <= f.history_mean[1] + 0.1
    assert length.max_len <= f.history_cap_max and length.max_len % 128 == 0
    assert f.history_sigma[0] <= length.sigma <= f.history_sigma[1]
    tables = w.all_tables
    assert f.num_tables[0] <= len(tables) <= f.num_tables[1]
    assert all(t.dim in f.table_dims and t.dim % 4 == 0 for t in tables)
    world = family_world(family, seed)
    assert world in f.world_sizes
    used = sum(t.num_rows * (t.dim * 2 + 4) for t in tables)
    from coplan.spec.loader import load_topology
    assert used <= f.table_hbm_fraction * load_topology(f.topology).gpu.hbm_bytes * world * 1.001
    if "moe" in bl:
        assert bl["moe"].num_experts in f.num_experts and 1 <= bl["moe"].top_k <= bl["moe"].num_experts
    assert w.batch.local(world) % 8 == 0 and f.local_batch[0] <= w.batch.local(world) <= f.local_batch[1]


def test_the_family_varies_what_it_says():
    """Across draws, every stated dimension of variety shows up (softmax and GDPA, MoE on and off,
    head counts that are not powers of two, several head dims)."""
    ws = [sample_workload("h200-1gpu", s) for s in range(60)]
    kinds = {_blocks(w)["interformer"].attention.kind for w in ws}
    assert kinds == {"softmax", "gdpa"}
    assert {("moe" in _blocks(w)) for w in ws} == {True, False}
    heads = {_blocks(w)["interformer"].num_heads for w in ws}
    assert any(h & (h - 1) for h in heads)
    assert len({_blocks(w)["interformer"].head_dim for w in ws}) >= 3


def test_bad_family_and_seed():
    with pytest.raises(CoplanError, match="no such family"):
        sample_workload("h100-1gpu", 1)
    for bad in (-1, 2**63, 1.5, True):
        with pytest.raises(CoplanError, match="--seed"):
            sample_workload("h200-1gpu", bad)
    # the range in full, as the CLI gives it, and family_world checks as sample_workload does
    with pytest.raises(CoplanError, match=r"--seed 9223372036854775808 is out of range; give a whole number from 0 to "
                                          r"9,223,372,036,854,775,807"):
        sample_workload("h200-1gpu", 2**63)
    for bad in (-1, 2**63):
        with pytest.raises(CoplanError, match=rf"--seed {bad} is out of range; give a whole number from 0 to "):
            family_world("h200-1gpu", bad)
    with pytest.raises(CoplanError, match="no such family"):
        family_world("h100-1gpu", 1)


@pytest.mark.parametrize("seed, why", [("-1", "is out of range"), (str(2**63), "is out of range"),
                                       ("1e3", "is not a whole number"), ("", "is not a whole number")])
def test_cli_seed_out_of_range_names_the_flag_the_value_and_the_range(seed, why, capsys):
    """sample-workload's seeds run to 2^63 - 1 (MAX_DRAW_SEED), not to CP-SAT's 2^31 - 1: its default, 'now', is
    the UTC date and time as YYYYMMDDHHMMSS (about 2 x 10^13), and a seed it printed must draw again."""
    assert main(["sample-workload", "--family", "h200-1gpu", f"--seed={seed}"]) == 2
    err = capsys.readouterr().err
    assert f"argument --seed: {seed!r} {why}; give a whole number from 0 to 9,223,372,036,854,775,807, or 'now'" in err, err


def test_the_seed_range_is_in_the_help_and_a_printed_now_seed_draws_again(capsys):
    with pytest.raises(SystemExit):
        main(["sample-workload", "--help"])
    assert "whole number from 0 to 9,223,372,036,854,775,807" in " ".join(capsys.readouterr().out.split())
    assert family_world("h200-1gpu", 20261207142638) >= 1  # a 'now' seed, past 2^31 - 1


def test_cli_writes_a_valid_workload(tmp_path, capsys):
    out = tmp_path / "draw.yaml"
    assert main(["sample-workload", "--family", "h200-1gpu", "--seed", "7", "-o", str(out)]) == 0
    assert "seed 7" in capsys.readouterr().err
    assert load_workload(str(out)) == sample_workload("h200-1gpu", 7)
    assert yaml.safe_load(out.read_text())["name"] == "h200-1gpu-draw-7"
    assert main(["sample-workload", "--list"]) == 0
    assert "h200-cluster" in capsys.readouterr().out
    assert main(["sample-workload", "--family", "h200-1gpu", "--seed", "x"]) == 2
    assert main(["sample-workload", "--family", "h200-1gpu", "-o", str(tmp_path)]) == 2
    assert main(["sample-workload", "--family", "h200-1gpu"]) == 0       # seed 'now'
    assert "# coplan sample-workload --family h200-1gpu --seed 20" in capsys.readouterr().out


@pytest.mark.parametrize("seed", [3, 11])
def test_one_gpu_draws_plan(seed, tmp_path):
    """A draw of the one-H200 family gets a plan on one H200 from `coplan plan` (the family's promise)."""
    src = tmp_path / "w.yaml"
    assert main(["sample-workload", "--family", "h200-1gpu", "--seed", str(seed), "-o", str(src)]) == 0
    assert main(["plan", "-t", "h200-1gpu", "-w", str(src), "-o", str(tmp_path / "plan.json"), "--time-limit", "30"]) == 0
