"""Entry files of the disk tier: header, checksums, per-layer writes and reads (no index).

An entry file is a valid safetensors file (readable with ``safetensors.safe_open``). Its tensors
are each layer's stored tensors (``ragblend.store.quant``: ``k``, ``v``, plus ``k_scale``,
``v_scale`` for int8) named ``<name>.<layer>``, layer after layer, so one layer is read with a
single positional read without touching the others. The header metadata carries everything
needed to use — or re-index — the file on its own: format version, key, model fingerprint,
compute dtype, storage dtype (``kv_dtype``), precompute context hash, token and layer counts,
and one checksum per layer over all of that layer's stored bytes (scales included).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ragblend.private import create_private
from ragblend.store.base import KVEntry
from ragblend.store.quant import dtype_name

try:  # xxh3 is ~10x faster than blake2b; blake2b (stdlib) is the fallback
    import xxhash
except ImportError:  # pragma: no cover - depends on the environment
    xxhash = None  # type: ignore[assignment]

FORMAT = "ragblend-kv"
FORMAT_VERSION = 2  # v2: named per-layer tensors (scales), kv_dtype in the header
_MAX_HEADER = 16 << 20
_ST_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int8: "I8",
    torch.uint8: "U8",
}
_TORCH_DTYPES = {v: k for k, v in _ST_DTYPES.items()}


class EntryInvalid(Exception):
    """Why an entry file cannot be used (turned into a miss by the tier).

    ``kind`` is ``"corrupt"`` (damaged, truncated, missing) or ``"foreign"`` (another format
    version, model, dtype or key than expected).
    """

    def __init__(self, reason: str, kind: str = "corrupt") -> None:
        super().__init__(reason)
        self.kind = kind


def checksum_algorithm() -> str:
    return "xxh3_64" if xxhash is not None else "blake2b_64"


def _hasher(algorithm: str):
    if algorithm == "xxh3_64" and xxhash is not None:
        return xxhash.xxh3_64()
    if algorithm == "blake2b_64":
        return hashlib.blake2b(digest_size=8)
    return None


def bytes_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor (no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy().data


@dataclass(frozen=True)
class EntryHeader:
    """An entry file's parsed header.

    ``meta``: the ragblend metadata (``key``, ``fingerprint``, ``dtype``, ``kv_dtype``,
    ``context``, ``tokens``, ``layers``, ``checksum``, ``checksums`` (list), ``meta`` (the
    entry's own JSON meta)); ``specs``: per-layer shape and dtype of each stored tensor name.
    """

    meta: dict
    data_start: int
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]]
    offsets: dict[str, tuple[int, int]]  # "<name>.<layer>" -> [begin, end) in the data buffer
    file_size: int

    @property
    def key(self) -> str:
        return str(self.meta["key"])

    @property
    def num_layers(self) -> int:
        return len(self.meta["checksums"])

    @property
    def num_tokens(self) -> int:
        return int(self.meta["tokens"])

    @property
    def data_bytes(self) -> int:
        return self.file_size - self.data_start

    def entry_meta(self) -> dict:
        """The entry's ``meta`` as it was stored, with the header's identity fields."""
        user = json.loads(self.meta.get("meta") or "{}")
        fields = ("fingerprint", "dtype", "context", "kv_dtype")
        return {**user, **{f: self.meta.get(f, "") for f in fields}, "tokens": self.num_tokens}


def identity(entry: KVEntry) -> dict[str, str]:
    """What an entry was computed with and how it is stored (header and index fields)."""
    first = entry.stored_layer(0)
    kv_dtype = str(entry.meta.get("kv_dtype") or dtype_name(first["k"].dtype))
    return {
        "fingerprint": str(entry.meta.get("fingerprint", "")),
        "dtype": str(entry.meta.get("dtype", "")),
        "kv_dtype": kv_dtype,
        "context": str(entry.meta.get("context", "")),
    }


def write_entry(path: Path, key: str, entry: KVEntry, fsync: bool) -> int:
    """Write ``entry`` as a new file at ``path`` (must not exist); returns its size."""
    layers = [
        {n: t.detach().to("cpu").contiguous() for n, t in entry.stored_layer(i).items()}
        for i in range(entry.num_layers)
    ]
    algorithm = checksum_algorithm()
    checksums = []
    for tensors in layers:
        h = _hasher(algorithm)
        for t in tensors.values():
            h.update(bytes_view(t))
        checksums.append(h.hexdigest())
    header = _build_header(key, entry, layers, checksums, algorithm)
    with create_private(path) as f:
        f.write(header)
        for tensors in layers:
            for t in tensors.values():
                f.write(bytes_view(t))
        f.flush()
        if fsync:
            os.fsync(f.fileno())
        return f.tell()


def _build_header(
    key: str,
    entry: KVEntry,
    layers: Sequence[dict[str, torch.Tensor]],
    checksums: list[str],
    algorithm: str,
) -> bytes:
    header: dict = {}
    offset = 0
    for i, tensors in enumerate(layers):
        for name, t in tensors.items():
            if t.dtype not in _ST_DTYPES:
                raise ValueError(f"cannot store dtype {t.dtype}")
            size = t.numel() * t.element_size()
            header[f"{name}.{i}"] = {
                "dtype": _ST_DTYPES[t.dtype],
                "shape": list(t.shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
    user = {k: v for k, v in entry.meta.items() if isinstance(v, (str, int, float, bool))}
    header["__metadata__"] = {
        "format": FORMAT,
        "version": str(FORMAT_VERSION),
        "key": key,
        **identity(entry),
        "tokens": str(entry.num_tokens),
        "layers": str(len(layers)),
        "names": json.dumps(list(layers[0])),
        "checksum": algorithm,
        "checksums": json.dumps(checksums),
        "meta": json.dumps(user, sort_keys=True),
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # safetensors aligns the data buffer to 8 bytes
    return struct.pack("<Q", len(raw)) + raw


def read_header(fd: int, key: str | None = None) -> EntryHeader:
    """Parse and check an entry file's header (``key``: the key it must belong to).

    Raises ``EntryInvalid`` when the file is not a complete entry of this format.
    """
    size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise EntryInvalid("truncated (no header)")
    (n,) = struct.unpack("<Q", head)
    if n > _MAX_HEADER or 8 + n > size:
        raise EntryInvalid("truncated or corrupt header")
    try:
        header = json.loads(os.pread(fd, n, 8))
        meta = header.pop("__metadata__")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise EntryInvalid(f"corrupt header ({exc})") from None
    if not isinstance(meta, dict):
        raise EntryInvalid("corrupt header metadata")
    if meta.get("format") != FORMAT or meta.get("version") != str(FORMAT_VERSION):
        raise EntryInvalid(
            f"format {meta.get('format')} v{meta.get('version')} is not ours", "foreign"
        )
    if key is not None and meta.get("key") != key:
        raise EntryInvalid("file belongs to another key", "foreign")
    if _hasher(str(meta.get("checksum"))) is None:
        raise EntryInvalid(f"checksum {meta.get('checksum')} is unavailable here", "foreign")
    try:
        layers, tokens = int(meta["layers"]), int(meta["tokens"])
        names = json.loads(meta["names"])
        checksums = json.loads(meta["checksums"])
        specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        offsets: dict[str, tuple[int, int]] = {}
        end = 0
        for i in range(layers):
            for name in names:
                info = header[f"{name}.{i}"]
                begin, stop = info["data_offsets"]
                spec = (tuple(info["shape"]), _TORCH_DTYPES[info["dtype"]])
                if begin != end or specs.setdefault(name, spec) != spec:
                    raise EntryInvalid("tensors out of order or of differing shapes")
                offsets[f"{name}.{i}"] = (begin, stop)
                end = stop
    except (KeyError, ValueError, TypeError) as exc:
        raise EntryInvalid(f"incomplete header ({exc!r})") from None
    if layers < 1 or "k" not in specs or len(checksums) != layers:
        raise EntryInvalid("header does not match its metadata")
    if len(specs["k"][0]) != 3 or specs["k"][0][1] != tokens:
        raise EntryInvalid("key tensor shape does not match the token count")
    if 8 + n + end != size:
        raise EntryInvalid(f"truncated ({size} bytes, expected {8 + n + end})")
    meta["checksums"] = checksums
    return EntryHeader(meta, 8 + n, specs, offsets, size)


def read_layer_into(fd: int, header: EntryHeader, index: int, out: dict[str, torch.Tensor]) -> None:
    """Read layer ``index``'s stored tensors into ``out`` (contiguous CPU tensors of the
    header's specs, one per name) with one positional read, and verify its checksum.

    Raises ``EntryInvalid`` on a short read, a read error or a checksum mismatch.
    """
    if not 0 <= index < header.num_layers:
        raise IndexError(f"layer {index} out of range ({header.num_layers} layers)")
    views = [bytes_view(out[name]) for name in header.specs]
    first = header.offsets[f"{next(iter(header.specs))}.{index}"][0]
    want = sum(e - b for b, e in (header.offsets[f"{n}.{index}"] for n in header.specs))
    if sum(len(v) for v in views) != want:
        raise ValueError("output tensors do not match the entry's layer shapes")
    try:
        got = os.preadv(fd, views, header.data_start + first)
    except OSError as exc:
        raise EntryInvalid(f"read error ({exc})") from None
    if got != want:
        raise EntryInvalid(f"short read of layer {index}")
    hasher = _hasher(header.meta["checksum"])
    for view in views:
        hasher.update(view)
    if hasher.hexdigest() != header.meta["checksums"][index]:
        raise EntryInvalid(f"checksum mismatch in layer {index}")


def empty_layer(header: EntryHeader, layers: int | None = None) -> dict[str, torch.Tensor]:
    """Uninitialised CPU tensors for one layer's stored tensors (or ``layers`` stacked)."""
    lead = () if layers is None else (layers,)
    return {n: torch.empty((*lead, *shape), dtype=dt) for n, (shape, dt) in header.specs.items()}
