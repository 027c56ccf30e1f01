"""Shared fixtures: tiny random-initialised models per family, and the embedded model."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(min(2, torch.get_num_threads()))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if not torch.cuda.is_available():
    # Triton's kernels run in its interpreter on CPU tensors (tests/test_triton_layer.py);
    # triton fixes the mode when it is first imported (transformers imports it), so here.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers import FAMILIES, tiny_config, tiny_model  # noqa: E402,F401 (tests import them here)


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    from ragblend.models.loading import embedded_model_dir

    return AutoTokenizer.from_pretrained(embedded_model_dir())


@pytest.fixture(scope="session")
def embedded_engine():
    """The embedded SmolLM2-135M-Instruct engine (RAM store, fp32, exact decode activations:
    the tight-tolerance gates)."""
    from ragblend import BlendConfig, BlendEngine

    config = BlendConfig(dtype="float32", decode_activations="float")
    return BlendEngine.from_pretrained("embedded", config=config)


@pytest.fixture(scope="session")
def dev_cases():
    """The first few MuSiQue dev cases: ../shared's where they are beside the checkout, else
    the cases shipped with the package (a clone with nothing beside it runs the same tests)."""
    import json

    from ragblend.bench.datasets import default_dataset

    return json.loads(default_dataset().read_text())[:5]


CHUNKS = [
    "Hannibal and Scipio is a Caroline era stage play written by Thomas Nabbes in 1635.",
    "Thomas Nabbes was an English dramatist. He was educated at Exeter College, Oxford.",
    "The Punica is a Latin epic poem in seventeen books written by Silius Italicus.",
]
QUESTION = "Where was the author of Hannibal and Scipio educated?"
