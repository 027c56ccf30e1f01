"""Fixtures for the LangChain package: the embedded model with canonical chunk context."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(min(2, torch.get_num_threads()))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# the question and passages of the plain-idiom and retrieval-chain tests
QUESTION = "Where was the author of Hannibal and Scipio educated?"
TEXTS = [
    "Hannibal and Scipio is a Caroline era stage play written by Thomas Nabbes in 1635.",
    "Thomas Nabbes was an English dramatist. He was educated at Exeter College, Oxford.",
    "Exeter College is a constituent college of the University of Oxford, founded in 1314.",
]


@pytest.fixture(scope="session")
def canonical_engine():
    """Embedded SmolLM2 engine (RAM store); chunks precomputed in the canonical context."""
    from ragblend import BlendConfig, BlendEngine

    return BlendEngine.from_pretrained(
        "embedded", config=BlendConfig(precompute_context="canonical")
    )


@pytest.fixture(scope="session")
def embedded_engine():
    """The embedded SmolLM2-135M-Instruct engine (RAM store), shared by the session."""
    from ragblend import BlendEngine

    return BlendEngine.from_pretrained("embedded")
