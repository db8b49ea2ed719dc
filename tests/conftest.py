"""Shared test set-up: one torch thread (REFERENCE 6), and the real default model resolved once."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The engine sets torch's thread count at start (engine/model_runner.py); tests run with one.
os.environ.setdefault("VBATCH_NUM_THREADS", "1")


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    try:
        import torch
    except ImportError:       # CLI-only tests must not need torch
        yield
        return
    torch.set_num_threads(1)
    yield


@pytest.fixture(scope="session")
def smollm2_path():
    """The default model as an HF folder (downloaded and converted once into the vbatch cache)."""
    from vbatch.engine.models.resolve import resolve_model
    return resolve_model("smollm2-135m-instruct").path
