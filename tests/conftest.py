"""Shared fixtures: tiny random-initialised models per family, and the embedded model."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(min(2, torch.get_num_threads()))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def tiny_config(family: str, **overrides):
    """A 3-layer GQA config of the family, sharing the embedded tokenizer's vocabulary."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config,
           "qwen3": Qwen3Config}[family]
    kwargs = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    if family == "qwen3":
        kwargs["head_dim"] = 16
    kwargs.update(overrides)
    return cls(**kwargs)


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides))
    return model.to(dtype).eval()


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    from ragblend.models.loading import embedded_model_dir

    return AutoTokenizer.from_pretrained(embedded_model_dir())


@pytest.fixture(scope="session")
def embedded_engine():
    """The embedded SmolLM2-135M-Instruct engine (RAM store), shared by the whole session."""
    from ragblend import BlendEngine

    return BlendEngine.from_pretrained("embedded")


@pytest.fixture(scope="session")
def dev_cases():
    """The first few MuSiQue dev cases (shared/data), or a skip when the file is absent."""
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "musique_dev.json"
    if not path.is_file():
        pytest.skip(f"{path} not found")
    return json.loads(path.read_text())[:5]


CHUNKS = [
    "Hannibal and Scipio is a Caroline era stage play written by Thomas Nabbes in 1635.",
    "Thomas Nabbes was an English dramatist. He was educated at Exeter College, Oxford.",
    "The Punica is a Latin epic poem in seventeen books written by Silius Italicus.",
]
QUESTION = "Where was the author of Hannibal and Scipio educated?"
