"""The transform coder's calibration basis: kept in the store under the model's fingerprint.

A model's basis (``ragblend.store.transform.Basis``) is calibrated once, from the KV of a fixed set
of calibration passages (:data:`CALIBRATION_CHUNKS` of the MuSiQue passages shipped in
``ragblend/data``, each cut to :data:`CALIBRATION_TOKENS` tokens, prefilled after the canonical
head), and stored like a chunk entry (float32; K and V rotations as its ``k`` and ``v``, the head
dimension as its token count) under ``ChunkCache.basis_key``: every tier keeps and verifies it with
its checksums, and every engine on the store reads the same basis. Coded entries name the basis id
in their key and meta, so an entry coded with another basis (another model, a lost race between two
calibrating processes) is never looked up, and one whose basis is not loaded here does not decode (a
miss, never a wrong value).

Bases in use are registered in this process (:func:`register`, :func:`loaded`), since a coded
entry decodes in whatever tier hands it out.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from importlib import resources

import torch

from ragblend.store.base import ChunkKV, KVEntry
from ragblend.store.transform import Basis, calibrate

log = logging.getLogger(__name__)

KIND = "pca-basis"
CALIBRATION_CHUNKS = 8
CALIBRATION_TOKENS = 512

_lock = threading.Lock()
_loaded: dict[str, Basis] = {}


def register(basis: Basis) -> Basis:
    """Make ``basis`` decodable in this process (by its id); returns it."""
    with _lock:
        _loaded.setdefault(basis.id, basis)
    return basis


def loaded(basis_id: str) -> Basis | None:
    """The registered basis with this id, or None."""
    with _lock:
        return _loaded.get(basis_id)


def calibration_texts(n: int = CALIBRATION_CHUNKS) -> list[str]:
    """The first passage of each shipped demo case, then their second ones, …: ``n`` texts."""
    raw = resources.files("ragblend.data").joinpath("musique_demo.json").read_text("utf-8")
    cases = json.loads(raw)
    texts: list[str] = []
    for rank in range(max(len(c["ctxs"]) for c in cases)):
        for case in cases:
            if rank < len(case["ctxs"]) and len(texts) < n:
                texts.append(case["ctxs"][rank]["text"])
    return texts


def as_entry(basis: Basis, meta: dict) -> ChunkKV:
    """``basis`` as a store entry (``meta``: the model's fingerprint and dtype)."""
    return ChunkKV(
        k=basis.k,
        v=basis.v,
        meta={
            **meta,
            "kind": KIND,
            "basis": basis.id,
            "kv_dtype": "float32",
            "compute_dtype": "float32",
        },
    )


def from_entry(entry: KVEntry, shape: tuple[int, int, int]) -> Basis | None:
    """The basis a store entry holds, or None (logged) when it is not one of this shape, or
    its tensors do not hash to the id it names."""
    try:
        held = entry.materialize()
        basis = Basis(k=held.k.to(torch.float32), v=held.v.to(torch.float32))
    except Exception as exc:  # a tier's read error: the basis is a miss
        log.warning("calibration basis unreadable (%s); recalibrating", exc)
        return None
    layers, heads, dim = shape
    want = (layers, heads, dim, dim)
    if (
        entry.meta.get("kind") != KIND
        or tuple(basis.k.shape) != want
        or basis.v.shape != basis.k.shape
    ):
        log.warning(
            "calibration basis entry is foreign (shape %s); recalibrating", tuple(basis.k.shape)
        )
        return None
    if basis.id != entry.meta.get("basis"):
        log.warning("calibration basis fails its id; recalibrating")
        return None
    return basis


def calibrate_from(kvs: Sequence[ChunkKV]) -> Basis:
    """The basis of chunks' KV (see ``ragblend.store.transform.calibrate``)."""
    return calibrate([kv.k for kv in kvs], [kv.v for kv in kvs])
