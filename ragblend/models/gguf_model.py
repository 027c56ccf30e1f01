"""Building the model of a GGUF file, tensor by tensor from the mapped file.

The model is created without weights (``accelerate.init_empty_weights``), then every tensor of
the file (:func:`ragblend.models.gguf.mapped_tensors`) is put in place:

- a Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K matrix of a linear or the token embedding stays
  as its blocks (``weights="auto"``, :mod:`ragblend.models.quantized`), rows reordered where
  transformers' fix-ups reorder them (Llama's q/k permutation);
- every other tensor (norms, biases, F16/BF16/F32 weights, quantized types without a kernel,
  or everything with ``weights="dequantize"``) is dequantized to the compute dtype with the
  ``gguf`` package's values and transformers' per-architecture fix-ups (Gemma's norm offset).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ragblend.errors import RagblendError
from ragblend.kernels import QUANT_TYPES, quant_kernels
from ragblend.models.gguf import SOURCE_FILE, check_weights, mapped_tensors
from ragblend.models.quantized import (
    QuantEmbedding,
    QuantizedWeight,
    QuantLinear,
    keep_dense_weights,
)

log = logging.getLogger(__name__)


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
    quantized tensors kept as blocks where ``weights="auto"`` and a kernel reads them (and,
    for a model whose linears fit :data:`~ragblend.models.quantized.KEEP_DENSE_BYTES` in
    ``dtype``, the dense weights its first prefill makes: :func:`keep_dense_weights`)."""
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
    for tensor in mapped_tensors(source, record):
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
    keep_dense_weights(model)
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
        bias: torch.Tensor | None = module.bias  # the file may hold it before or after
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
