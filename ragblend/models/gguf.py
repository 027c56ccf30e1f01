"""Any GGUF file of a supported family → an HF safetensors directory, converted once.

The directory is ``$RAGBLEND_HOME/models/<sha256 of the file>/`` (config, tokenizer, shards of
safetensors and their index). The conversion streams: the GGUF is memory-mapped (the ``gguf``
package's reader), each tensor is dequantised, renamed with transformers' own GGUF name map and
its per-architecture fix-ups (Llama's q/k row permutation, Gemma's norm offset), and written
into shards of at most ``shard_bytes``; only one shard is ever held in memory. (Loading through
``from_pretrained(gguf_file=...)`` instead holds every dequantised tensor in a dict and then the
model: twice the model.) It writes into a temporary directory renamed into place at the end, so
a conversion killed half-way leaves nothing that loads, and the next call converts again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ragblend.errors import RagblendError
from ragblend.models.adapters import check_supported
from ragblend.paths import models_dir

log = logging.getLogger(__name__)

SHARD_BYTES = 1 << 29  # 512 MiB of converted tensors per safetensors shard
INDEX_FILE = "model.safetensors.index.json"
_STAGING_PREFIX = ".convert-"


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's contents, read in blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def gguf_model_dir(path: str | os.PathLike) -> Path:
    """The converted directory of the GGUF file ``path`` (converting it on first use)."""
    source = Path(path).expanduser()
    if not source.is_file():
        raise RagblendError(f"{path!s}: no such GGUF file")
    target = models_dir() / file_sha256(source)
    if not (target / "config.json").is_file():
        convert_gguf(source, target)
    return target


def convert_gguf(
    source: Path,
    target: Path,
    shard_bytes: int = SHARD_BYTES,
    after_shard: Callable[[int], None] | None = None,
) -> None:
    """Convert ``source`` into an HF model directory at ``target`` (atomically).

    ``after_shard(i)`` is called once shard ``i`` is written (the crash tests kill there)."""
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    _remove_dead_stagings(target.parent)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f"{_STAGING_PREFIX}{os.getpid()}-"))
    try:
        log.info("converting %s to safetensors in %s (once)", source.name, target)
        config = _config(source)
        _write_weights(source, config, staging, shard_bytes, after_shard)
        config.save_pretrained(staging)
        _tokenizer(source).save_pretrained(staging)
        for file in staging.iterdir():
            file.chmod(0o600)
        if (target / "config.json").is_file():  # another process won the race
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


def _write_weights(
    source: Path,
    config: Any,
    staging: Path,
    shard_bytes: int,
    after_shard: Callable[[int], None] | None,
) -> None:
    import gguf
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    reader = gguf.GGUFReader(source)
    arch = str(reader.fields["general.architecture"].contents())
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    names = get_gguf_hf_weights_map(skeleton, processor)
    expected = set(skeleton.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    del skeleton

    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        nonlocal shard, size
        file = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, staging / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
        shard, size = {}, 0
        if after_shard is not None:
            after_shard(len(set(weight_map.values())))

    for tensor in reader.tensors:
        values = gguf.dequantize(tensor.data, tensor.tensor_type)
        result = processor.process(weights=values, name=tensor.name)
        name = names.get(result.name)
        if name is None or name not in expected:
            continue
        converted = _exact_dtype(result.weights, tensor.tensor_type)
        shard[name] = converted
        size += converted.nbytes
        total += converted.nbytes
        if size >= shard_bytes:
            flush()
    if shard:
        flush()
    missing = sorted(expected - set(weight_map))
    if missing:
        raise RagblendError(
            f"{source}: the GGUF has no tensor for {len(missing)} weights of "
            f"{config.architectures[0]} (e.g. {missing[0]})"
        )
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (staging / INDEX_FILE).write_text(json.dumps(index, indent=1))


def _exact_dtype(values: np.ndarray, ggml_type: int) -> torch.Tensor:
    """The tensor in the file's own float type where that holds its values exactly (F16/BF16
    weights stay half-size), else float32 (dequantised blocks)."""
    import gguf

    if not values.flags.writeable or values.dtype != np.float32:  # a view of the mapped file
        values = np.array(values, dtype=np.float32)
    tensor = torch.from_numpy(np.ascontiguousarray(values))
    half = {
        gguf.GGMLQuantizationType.F16: torch.float16,
        gguf.GGMLQuantizationType.BF16: torch.bfloat16,
    }.get(gguf.GGMLQuantizationType(ggml_type))
    if half is not None:
        narrow = tensor.to(half)
        if torch.equal(narrow.float(), tensor):
            return narrow
    return tensor


def _remove_dead_stagings(parent: Path) -> None:
    """Remove staging directories left by conversions whose process has died."""
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
