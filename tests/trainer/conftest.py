"""Trainer tests need torch, TorchRec and pyarrow (the ``[train]`` extra); skip cleanly without them."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("torchrec")
pytest.importorskip("pyarrow")
