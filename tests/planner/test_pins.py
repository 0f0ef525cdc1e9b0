"""``--pin-table`` refusals say why (:mod:`coplan.planner.pins`): the table, the pin, the reason (a shard count that
does not divide the table's dim, shards under the narrowest column-wise shard, a sparse group too small, a table too
large to copy, a sequence table) and the fix, which lists the shardings the table can take there."""

from __future__ import annotations

import pytest

from coplan.cli import main
from coplan.planner.pins import table_pin_problem
from coplan.spec import dump_spec, load_workload


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """gem-tiny with user_id 128 wide, hist_item 96 wide and ad_id too large to copy on every rank."""
    w = load_workload("gem-tiny")
    size = {"user_id": {"dim": 128}, "hist_item": {"dim": 96}, "ad_id": {"num_rows": 500_000_000}}
    tables = tuple(t.model_copy(update=size.get(t.name, {})) for t in w.tables)
    w = type(w).model_validate(w.model_copy(update={"tables": tables}).model_dump())
    return str(dump_spec(w, tmp_path_factory.mktemp("pins") / "wide.yaml"))


def _refusal(argv: list[str], capsys, tmp_path) -> str:
    assert main(["plan", *argv, "-o", str(tmp_path / "p.json"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "internal error" not in err and not (tmp_path / "p.json").exists(), err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


CASES = [
    (["-t", "h200-hgx-2gpu", "-w", "WIDE", "--pin-table", "hist_item=column_wise/64"],
     "--pin-table hist_item=column_wise/64: the table's 96 columns do not split into 64 equal shards; "
     "'hist_item' (dim 96) takes column_wise/2"),
    (["-t", "h200-hgx-2gpu", "-w", "WIDE", "--pin-table", "user_id=column_wise/8"],
     "--pin-table user_id=column_wise/8: 8 shards of the table's 128 columns are 16 wide, under the narrowest column-wise "
     "shard (32 columns); 'user_id' (dim 128) takes column_wise/2, column_wise/4"),
    (["-t", "h200-hgx-2gpu", "-w", "WIDE", "--pin-table", "user_id=column_wise/3"],
     "column-wise shard counts are powers of two; 'user_id' (dim 128) takes column_wise/2, column_wise/4"),
    (["-t", "h200-hgx-2gpu", "-w", "gem-tiny", "--pin-table", "user_id=column_wise"],
     "--pin-table user_id=column_wise: 'user_id' (dim 16) takes no column-wise split (even 2 shards would be 8 columns "
     "wide, under the narrowest column-wise shard of 32 columns): pin another sharding"),
    (["-t", "h200-hgx-2gpu", "-w", "gem-tiny", "--pin-table", "user_id=column_wise/0"],
     "the shard count N of column_wise/N is a whole number of at least 2 (one shard is table_wise)"),
    (["-t", "h200-hgx-2gpu", "-w", "gem-tiny", "--pin-table", "user_id=row_wise/2"],
     "only column_wise takes a shard count (/N); row_wise shards over the whole sparse group: give 'user_id=row_wise'"),
    (["-t", "h200-hgx-2gpu", "-w", "gem-tiny", "--pin-table", "user_id=rowwise"],
     "'rowwise' is not a sharding; give one of table_wise, row_wise, column_wise, table_row_wise, data_parallel"),
    (["-t", "h200-hgx-2gpu", "-w", "gem-tiny", "--pin-table", "user_ud=row_wise"],
     "--pin-table user_ud=row_wise: 'user_ud' is not a table of workload 'gem-tiny'; did you mean 'user_id'?"),
    # what only the mesh rules out: the fix lists what the table can take there
    (["-t", "h200-hgx-2gpu", "-w", "WIDE", "--pin-table", "user_id=column_wise/4"],
     "--pin-table user_id=column_wise/4: 4 column shards need a sparse group of at least 4 ranks, and the largest here "
     "has 2: plan on more GPUs (--gpus) or let the sparse group grow (a --pin on sparse_shard or sparse_replicate); pin "
     "one of the shardings 'user_id' (dim 128) can take here: table_wise, data_parallel, column_wise/2, row_wise, or "
     "drop the pin"),
    (["-t", "h200-1gpu", "-w", "gem-tiny", "--pin-table", "user_id=row_wise"],
     "row_wise needs a sparse group of more than one rank, and every sparse group here has 1"),
    (["-t", "h200-1gpu", "-w", "gem-tiny", "--pin-table", "user_id=table_row_wise"],
     "table_row_wise splits a table within a node and across nodes, and 'h200-1gpu' has one GPU per node; pin one of "
     "the shardings 'user_id' (dim 16) can take here: table_wise, data_parallel, or drop the pin"),
    (["-t", "h200-superpod-1k", "--gpus", "8", "-w", "gem-tiny", "--pin-table", "user_id=table_row_wise"],
     "table_row_wise needs a sparse group of whole nodes, more than one (8 GPUs each on 'h200-superpod-1k'), and the "
     "sparse groups here have 1, 2, 4, 8 rank(s)"),
    (["-t", "h200-hgx-2gpu", "-w", "WIDE", "--pin-table", "ad_id=data_parallel"],
     "a full copy of 'ad_id' (weights and optimizer state, 31.66 GiB) is over the 2.63 GiB (2% of a GPU's HBM) a "
     "data-parallel table may take; pin one of the shardings 'ad_id' (dim 16) can take here: table_wise, row_wise"),
]


@pytest.mark.parametrize("argv, want", CASES, ids=[c[0][-1] + " " + c[0][1] for c in CASES])
def test_a_pin_table_refusal_says_why_and_what_to_pin(argv, want, wide, capsys, tmp_path):
    line = _refusal([wide if a == "WIDE" else a for a in argv], capsys, tmp_path)
    assert want in line, line
    assert "no mesh candidate can shard" not in line


def test_a_pin_that_holds_is_kept(wide, tmp_path, capsys):
    assert main(["plan", "-t", "h200-hgx-2gpu", "-w", wide, "--pin-table", "hist_item=column_wise/2", "--pin-table",
                 "user_id=column_wise/2", "-o", str(tmp_path / "p.json"), "--quiet"]) == 0, capsys.readouterr().err
    from coplan.spec import load_plan
    kinds = {t.table: (t.sharding_type, len(t.ranks)) for t in load_plan(str(tmp_path / "p.json")).tables}
    assert kinds["hist_item"] == ("column_wise", 2) and kinds["user_id"] == ("column_wise", 2)


@pytest.mark.parametrize("want", ["table_wise", "row_wise", "data_parallel", "table_row_wise", "column_wise",
                                  "column_wise/2", "column_wise/4"])
def test_what_the_table_takes_is_not_refused_early(want):
    assert table_pin_problem("t", 128, want, 32) is None
