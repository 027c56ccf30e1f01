"""Where ragblend keeps its files: ``$RAGBLEND_HOME`` and the directories under it."""

from __future__ import annotations

import os
from pathlib import Path


def ragblend_home() -> Path:
    """Root of ragblend's caches: ``$RAGBLEND_HOME`` or ``~/.cache/ragblend``."""
    return Path(os.environ.get("RAGBLEND_HOME", Path.home() / ".cache" / "ragblend"))


def models_dir() -> Path:
    """Converted models (the embedded GGUF as safetensors)."""
    return ragblend_home() / "models"


def kv_dir() -> Path:
    """The default disk tier of the KV store."""
    return ragblend_home() / "kv"


def profiles_dir() -> Path:
    """Cached loading-controller profiles."""
    return ragblend_home() / "profiles"
