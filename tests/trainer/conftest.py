"""Trainer tests need torch, TorchRec and pyarrow (the ``[train]`` extra); skip cleanly without them."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("torchrec")
pytest.importorskip("pyarrow")


@pytest.fixture(scope="session")
def one_rank_group(tmp_path_factory):
    """A one-rank gloo process group in this process (FSDP2 on a one-rank CPU mesh)."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()
