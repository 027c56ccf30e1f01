"""Any GGUF file of a supported family → an HF model, its quantized tensors kept as stored.

Two steps. **Once per file** (:func:`gguf_model_dir`): the HF config and tokenizer that
transformers reads from the GGUF's metadata (the tokenizer takes seconds to build) are written
to ``$RAGBLEND_HOME/models/gguf-<key>/``, keyed by the file's path, size and mtime (its sha256
is computed then and recorded in ``source.json``, never again), through a staging directory
renamed into place: a write killed half-way leaves nothing that loads. **Each load**
(:func:`load_gguf_model`): the model is built without weights, and every tensor of the
memory-mapped file is put in place:

- a Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K matrix of a linear or the token embedding stays
  as its blocks (``weights="auto"``, :mod:`ragblend.models.quantized`), rows reordered where
  transformers' fix-ups reorder them (Llama's q/k permutation);
- every other tensor (norms, biases, F16/BF16/F32 weights, quantized types without a kernel,
  or everything with ``weights="dequantize"``) is dequantized to the compute dtype with the
  ``gguf`` package's values and transformers' per-architecture fix-ups (Gemma's norm offset).
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
import torch
from torch import nn

from ragblend.errors import RagblendError
from ragblend.models.adapters import check_supported
from ragblend.models.quant_kernels import QUANT_TYPES, quant_kernels
from ragblend.models.quantized import QuantEmbedding, QuantizedWeight, QuantLinear
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


def _mapped_tensors(source: Path, record: dict[str, Any]) -> list[GGUFTensor]:
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


def _gguf_names(model: Any, processor: Any, arch: str) -> dict[str, str]:
    """GGUF tensor name → HF parameter name (transformers' map, built once rather than once
    per submodule as its ``get_gguf_hf_weights_map`` does)."""
    import gguf

    arch_id = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), None)
    if arch_id is None:
        raise RagblendError(f"the gguf package does not know the architecture {arch!r}")
    name_map = gguf.get_tensor_name_map(arch_id, model.config.num_hidden_layers)
    names: dict[str, str] = {}
    for hf_name in model.state_dict():
        base, _, suffix = processor.preprocess_name(hf_name).rpartition(".")
        gguf_name = name_map.get_name(base)
        if gguf_name is not None:
            names[f"{gguf_name}.{suffix}"] = hf_name
    return names


def load_gguf_model(
    source: Path, directory: Path, dtype: torch.dtype, weights: str = "auto"
) -> nn.Module:
    """The model of the GGUF ``source`` (config from ``directory``) in ``dtype``, its
    quantized tensors kept as blocks where ``weights="auto"`` and a kernel reads them."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    keep = check_weights(weights) == "auto"
    config = AutoConfig.from_pretrained(directory)
    record = json.loads((directory / SOURCE_FILE).read_text())
    with init_empty_weights(include_buffers=False):
        model: Any = AutoModelForCausalLM.from_config(config, dtype=dtype)
    arch = record["architecture"]
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    names = _gguf_names(model, processor, arch)
    expected = set(model.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")

    loaded: set[str] = set()
    no_kernel: set[str] = set()
    for tensor in _mapped_tensors(source, record):
        qtype = int(tensor.tensor_type)
        quantized = tensor.tensor_type not in _FLOAT_TYPES
        if quantized and qtype not in QUANT_TYPES:
            no_kernel.add(tensor.tensor_type.name)
        blocks = keep and qtype in QUANT_TYPES and tensor.data.ndim == 2
        kept = blocks and _keep_blocks(model, processor, names, expected, tensor, dtype, loaded)
        if not kept:
            _put_dense(model, processor, names, expected, tensor, dtype, loaded)
    if no_kernel:
        log.info(
            "%s: %s tensors are dequantized to %s (ragblend has no kernel for them)",
            source.name,
            ", ".join(sorted(no_kernel)),
            dtype,
        )
    _tie_embeddings(model, loaded)
    missing = sorted(expected - loaded)
    if missing:
        raise RagblendError(
            f"{source}: the GGUF has no tensor for {len(missing)} weights of "
            f"{config.architectures[0]} (e.g. {missing[0]})"
        )
    return model.eval()


_FLOAT_TYPES = frozenset({0, 1, 30})  # F32, F16, BF16


def _hf_name(processor: Any, names: dict[str, str], gguf_name: str, rows: int) -> tuple:
    """(HF parameter name or None, row order or None) of a GGUF matrix of ``rows`` rows: the
    fix-up transformers applies to it, run on the row indices. The order is None where the
    fix-up is no reordering of whole rows (the tensor must then be dequantized)."""
    index = np.arange(rows, dtype=np.float32).reshape(rows, 1)
    result = processor.process(weights=index, name=gguf_name)
    name = names.get(result.name) if result.name is not None else None
    order = np.asarray(result.weights)
    if order.shape != (rows, 1) or not np.array_equal(np.sort(order[:, 0]), index[:, 0]):
        return name, None
    return name, order[:, 0].astype(np.int64)


def _keep_blocks(model, processor, names, expected, tensor, dtype, loaded) -> bool:
    rows, row_bytes = tensor.data.shape
    name, order = _hf_name(processor, names, tensor.name, rows)
    if name is None or name not in expected or order is None or not name.endswith(".weight"):
        return False
    parent_name, _, _ = name.rpartition(".")
    module = model.get_submodule(parent_name)
    data = torch.from_numpy(tensor.data)
    if not np.array_equal(order, np.arange(rows)):
        data = data[torch.from_numpy(order)].contiguous()
    cols = int(tensor.shape[0])  # ggml's shape is (cols, rows)
    weight = QuantizedWeight(data, int(tensor.tensor_type), cols)
    if isinstance(module, nn.Linear):
        bias = module.bias  # the file's bias tensor may come before or after the matrix
        if bias is not None and bias.is_meta:
            bias = torch.zeros(bias.shape, dtype=dtype)  # replaced by the bias tensor's values
        replacement: nn.Module = QuantLinear(weight, bias, dtype)
    elif isinstance(module, nn.Embedding):
        replacement = QuantEmbedding(weight, dtype, getattr(module, "embed_scale", None))
    else:
        return False
    parent, _, leaf = parent_name.rpartition(".")
    model.get_submodule(parent).register_module(leaf, replacement)
    loaded.add(name)
    return True


def _put_dense(model, processor, names, expected, tensor, dtype, loaded) -> None:
    import gguf

    qtype = int(tensor.tensor_type)
    kernels = quant_kernels()
    if qtype in QUANT_TYPES and kernels is not None and tensor.data.ndim == 2:
        values: Any = kernels.dequantize(
            torch.from_numpy(tensor.data), qtype, int(tensor.shape[0]), torch.float32
        ).numpy()
    else:
        values = gguf.dequantize(tensor.data, tensor.tensor_type)
    result = processor.process(weights=values, name=tensor.name)
    name = names.get(result.name) if result.name is not None else None
    if name is None or name not in expected:
        return
    array = np.ascontiguousarray(result.weights)
    if array.dtype != np.float32:
        array = array.astype(np.float32)
    value = torch.from_numpy(array).to(dtype)
    parent_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(parent_name)
    module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    loaded.add(name)


def _tie_embeddings(model: Any, loaded: set[str]) -> None:
    """Point the LM head at the token embedding where the config ties them and the file has
    no output matrix of its own."""
    if not model.config.tie_word_embeddings or "lm_head.weight" in loaded:
        return
    embedding = model.get_input_embeddings()
    if isinstance(embedding, QuantEmbedding):
        model.lm_head = QuantLinear(embedding.qweight, None, embedding.dtype)
    else:
        model.lm_head.weight = embedding.weight


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
