"""Any GGUF file of a supported family: what ragblend reads of it once, and its mapped tensors.

**Once per file** (:func:`gguf_model_dir`): the HF config and tokenizer that transformers reads
from the GGUF's metadata (the tokenizer takes seconds to build) and the file's tensor table are
written to ``$RAGBLEND_HOME/models/gguf-<key>/``, keyed by the file's path, size and mtime (its
sha256 is computed then and recorded in ``source.json``, never again), through a staging
directory renamed into place: a write killed half-way leaves nothing that loads. **Each
load** maps the file (:func:`mapped_tensors`) and builds the model from it
(:mod:`ragblend.models.gguf_model`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, NamedTuple, get_args

import numpy as np

from ragblend.errors import RagblendError
from ragblend.models.adapters import check_supported
from ragblend.paths import models_dir
from ragblend.private import make_private, private_dir, private_temp_dir

log = logging.getLogger(__name__)

Weights = Literal["auto", "dequantize"]
WEIGHTS: tuple[str, ...] = get_args(Weights)
SOURCE_FILE = "source.json"
_STAGING_PREFIX = ".convert-"


def check_weights(choice: str) -> str:
    """``choice`` if it is a ``weights`` value, else a RagblendError naming them."""
    if choice not in WEIGHTS:
        raise RagblendError(f"unknown weights {choice!r}; expected one of {', '.join(WEIGHTS)}")
    return choice


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's contents, read in blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def gguf_model_dir(path: str | os.PathLike) -> Path:
    """The config and tokenizer directory of the GGUF file ``path`` (written on first use)."""
    source = Path(path).expanduser()
    if not source.is_file():
        raise RagblendError(f"{path!s}: no such GGUF file")
    stat = source.stat()
    key = f"{source.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    target = models_dir() / f"gguf-{hashlib.sha256(key.encode()).hexdigest()[:32]}"
    if not _prepared(target):
        prepare_gguf_dir(source, target)
    return target


def _prepared(target: Path) -> bool:
    """Whether ``target`` holds a complete preparation of this ragblend's format."""
    try:
        return "tensors" in json.loads((target / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False


def prepare_gguf_dir(
    source: Path, target: Path, after_config: Callable[[], None] | None = None
) -> None:
    """Write ``source``'s config, tokenizer and ``source.json`` into ``target`` (atomically).

    ``after_config()`` is called once the config is written (the crash tests kill there)."""
    private_dir(target.parent)
    _remove_dead_stagings(target.parent)
    staging = private_temp_dir(target.parent, f"{_STAGING_PREFIX}{os.getpid()}-")
    try:
        log.info("reading %s's config and tokenizer into %s (once)", source.name, target)
        _config(source).save_pretrained(staging)
        if after_config is not None:
            after_config()
        _tokenizer(source).save_pretrained(staging)
        stat = source.stat()
        record = {"path": str(source.resolve()), "size": stat.st_size}
        record |= {"mtime_ns": stat.st_mtime_ns, "sha256": file_sha256(source)}
        record |= _tensor_table(source)
        (staging / SOURCE_FILE).write_text(json.dumps(record, indent=1))
        make_private(staging)
        if _prepared(target):  # another process won the race
            return
        if target.exists():  # a foreign or broken directory under our name
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _config(source: Path) -> Any:
    """The HF config transformers reads from the GGUF's metadata, with the architecture set
    and what the metadata leaves out filled in the way llama.cpp runs the file."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name)
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise RagblendError(f"{source}: cannot read it as a GGUF model: {exc}") from exc
    model_class: Any = AutoModelForCausalLM._model_mapping.get(type(config), None)
    architecture = model_class.__name__ if model_class is not None else config.model_type
    check_supported(architecture)
    config.architectures = [architecture]
    from transformers.integrations.gguf import read_gguf_metadata

    metadata, _ = read_gguf_metadata(str(source))
    key_length = metadata.get(f"{metadata['general.architecture']}.attention.key_length")
    if key_length is not None and hasattr(config, "head_dim"):  # transformers skips it for Qwen3
        config.head_dim = int(key_length)
    if architecture == "Gemma3ForCausalLM":
        # llama.cpp scales Gemma 3's queries by 1/sqrt(head_dim) (27B: hidden/heads), which the
        # GGUF does not record; HF's config calls it query_pre_attn_scalar.
        big = config.num_hidden_layers == 62
        heads_dim = config.hidden_size // config.num_attention_heads
        config.query_pre_attn_scalar = heads_dim if big else config.head_dim
    return config


def _tokenizer(source: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)


class GGUFTensor(NamedTuple):
    """One tensor of a mapped GGUF: ``shape`` in ggml's order (columns first), ``data`` as the
    ``gguf`` package's reader gives it (F32/F16: the values, reversed shape; quantized types:
    uint8 [rows, row_bytes])."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


def _tensor_table(source: Path) -> dict[str, Any]:
    """The file's architecture and tensor table (name, type, shape, offset): reading them
    takes the ``gguf`` package seconds (it parses the tokenizer's arrays), so once."""
    import gguf

    try:
        reader = gguf.GGUFReader(source)
    except (ValueError, OSError) as exc:
        raise RagblendError(f"{source}: cannot read it as a GGUF model: {exc}") from exc
    tensors = [
        [t.name, int(t.tensor_type), [int(n) for n in t.shape], int(t.data_offset), int(t.n_bytes)]
        for t in reader.tensors
    ]
    return {
        "architecture": str(reader.fields["general.architecture"].contents()),
        "tensors": tensors,
    }


def mapped_tensors(source: Path, record: dict[str, Any]) -> list[GGUFTensor]:
    """The tensors of ``source`` (copy-on-write mapped: torch gets writable views, the file
    is never written) from its recorded table."""
    import gguf
    from gguf.quants import quant_shape_to_byte_shape

    mapped = np.memmap(source, mode="c")
    floats = {0: np.float32, 1: np.float16}
    tensors = []
    for name, qtype, shape, offset, nbytes in record["tensors"]:
        kind = gguf.GGMLQuantizationType(qtype)
        dims = tuple(reversed(shape))
        raw = mapped[offset : offset + nbytes]
        if qtype in floats:
            data = raw.view(floats[qtype]).reshape(dims)
        else:
            data = raw.reshape(quant_shape_to_byte_shape(dims, kind))
        tensors.append(GGUFTensor(name, kind, tuple(shape), data))
    return tensors


def _remove_dead_stagings(parent: Path) -> None:
    """Remove staging directories left by writers whose process has died."""
    for staging in parent.glob(f"{_STAGING_PREFIX}*"):
        pid = staging.name.removeprefix(_STAGING_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(staging, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
