"""KV store: content keys, chunk KV entries and storage tiers."""

from ragblend.store.base import ChunkKV, KVStore, StoreStats
from ragblend.store.keys import chunk_key, model_fingerprint
from ragblend.store.memory import MemoryStore

__all__ = ["ChunkKV", "KVStore", "MemoryStore", "StoreStats", "chunk_key", "model_fingerprint"]
