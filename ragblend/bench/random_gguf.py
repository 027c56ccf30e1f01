"""Real GGUF files of the benchmark shapes, random weights in quantized blocks.

:func:`write_random_gguf` writes a shape of :data:`ragblend.bench.shapes.SHAPES` as the file
llama.cpp's quantizer would write for it, tensor by tensor (never the whole model in memory):
the architecture's metadata, the embedded model's tokenizer (its vocabulary padded with unused
tokens to the shape's size) and every matrix as random blocks of the mix's type — ``Q4_K_M``
(llama.cpp's mix: Q4_K, with Q6_K for the output matrix and for ``attn_v`` / ``ffn_down`` of
the layers it gives more bits) or ``Q8_0`` — with scales small enough that the weights are of
a trained model's size (|w| ≲ 0.1). Norms are ones, biases zeros, both F32. Random weights
give true compute timings, not answers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ragblend.bench.shapes import SHAPES

QUANTS: tuple[str, ...] = ("Q4_K_M", "Q8_0")
_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the first and last eighth of the layers and every third
    one between them get Q6_K for attn_v and ffn_down in Q4_K_M."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


# llama.cpp's types for a row whose length is no multiple of a K type's 256 weights
_K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def tensor_type(name: str, quant: str, layers: int, cols: int = 256) -> str:
    """The ggml type name ``quant``'s mix gives the matrix ``name`` (a GGUF tensor name) of
    rows of ``cols`` weights (a K type where ``cols`` is a multiple of 256, else llama.cpp's
    fallback, e.g. Qwen2.5-0.5B's 896-wide rows)."""
    if quant == "Q8_0":
        return "Q8_0"
    if name == "output.weight":
        chosen = "Q6_K"
    elif name.endswith(("attn_v.weight", "ffn_down.weight")):
        chosen = "Q6_K" if more_bits(int(name.split(".")[1]), layers) else "Q4_K"
    else:
        chosen = "Q4_K"
    return chosen if cols % 256 == 0 else _K_FALLBACK[chosen]


def random_blocks(rows: int, cols: int, type_name: str, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row_bytes] of random ``type_name`` blocks whose f16 scales keep |w| small."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    elems, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // elems, size), dtype=np.uint8)
    # d (Q6_K: its last two bytes) and m / dmin; mean |w| about 0.02, as in trained models
    value = {"Q6_K": 2e-5, "Q4_K": 8e-5, "Q5_K": 4e-5}.get(type_name, 3e-4)
    scales = [(size - 2, value)] if type_name == "Q6_K" else [(0, value)]
    if type_name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):
        scales.append((2, value))
    for offset, value in scales:
        signs = np.where(rng.integers(0, 2, size=len(blocks)) == 1, 1.0, -1.0)
        blocks[:, offset : offset + 2] = (signs * value).astype(np.float16)[:, None].view(np.uint8)
    return blocks.reshape(rows, -1)


def _matrices(spec: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(GGUF name, rows, cols) of every matrix of the shape."""
    hidden, layers, vocab = spec["hidden_size"], spec["num_hidden_layers"], spec["vocab_size"]
    head_dim = spec.get("head_dim") or hidden // spec["num_attention_heads"]
    q, kv, ffn = (
        spec["num_attention_heads"] * head_dim,
        spec["num_key_value_heads"] * head_dim,
        spec["intermediate_size"],
    )
    out = [("token_embd.weight", vocab, hidden)]
    for i in range(layers):
        out += [
            (f"blk.{i}.attn_q.weight", q, hidden),
            (f"blk.{i}.attn_k.weight", kv, hidden),
            (f"blk.{i}.attn_v.weight", kv, hidden),
            (f"blk.{i}.attn_output.weight", hidden, q),
            (f"blk.{i}.ffn_gate.weight", ffn, hidden),
            (f"blk.{i}.ffn_up.weight", ffn, hidden),
            (f"blk.{i}.ffn_down.weight", hidden, ffn),
        ]
    if not spec.get("tie_word_embeddings"):
        out.append(("output.weight", vocab, hidden))
    return out


def _vectors(spec: dict[str, Any]) -> list[tuple[str, int, float]]:
    """(GGUF name, length, value) of every norm (ones) and bias (zeros)."""
    hidden, layers = spec["hidden_size"], spec["num_hidden_layers"]
    head_dim = spec.get("head_dim") or hidden // spec["num_attention_heads"]
    out = [("output_norm.weight", hidden, 1.0)]
    for i in range(layers):
        out += [
            (f"blk.{i}.attn_norm.weight", hidden, 1.0),
            (f"blk.{i}.ffn_norm.weight", hidden, 1.0),
        ]
        if spec["family"] == "qwen2":
            q = spec["num_attention_heads"] * head_dim
            kv = spec["num_key_value_heads"] * head_dim
            out += [
                (f"blk.{i}.attn_q.bias", q, 0.0),
                (f"blk.{i}.attn_k.bias", kv, 0.0),
                (f"blk.{i}.attn_v.bias", kv, 0.0),
            ]
    return out


def _metadata(writer: Any, spec: dict[str, Any], name: str) -> None:
    import gguf

    from ragblend.models.loading import embedded_gguf_path

    hidden = spec["hidden_size"]
    head_dim = spec.get("head_dim") or hidden // spec["num_attention_heads"]
    writer.add_name(name)
    writer.add_context_length(spec["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_block_count(spec["num_hidden_layers"])
    writer.add_feed_forward_length(spec["intermediate_size"])
    writer.add_head_count(spec["num_attention_heads"])
    writer.add_head_count_kv(spec["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(spec["rms_norm_eps"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(spec["rope_theta"])
    writer.add_rope_dimension_count(head_dim)
    source = gguf.GGUFReader(embedded_gguf_path())
    fields = {k: source.fields[k].contents() for k in source.fields if k.startswith("tokenizer.")}
    tokens, types = list(fields["tokenizer.ggml.tokens"]), list(fields["tokenizer.ggml.token_type"])
    pad = spec["vocab_size"] - len(tokens)
    tokens += [f"<unused_{i}>" for i in range(pad)]
    types += [gguf.TokenType.UNUSED] * pad
    writer.add_tokenizer_model(fields["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(fields["tokenizer.ggml.pre"])
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(fields["tokenizer.ggml.merges"])
    writer.add_bos_token_id(fields["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(fields["tokenizer.ggml.eos_token_id"])
    if "tokenizer.chat_template" in fields:
        writer.add_chat_template(fields["tokenizer.chat_template"])


def write_random_gguf(shape: str, quant: str, path: Path, seed: int = 0) -> Path:
    """Write ``shape`` with random weights as a ``quant`` GGUF at ``path`` (see the module
    docstring); its vocabulary is at least the embedded tokenizer's."""
    import gguf

    if quant not in QUANTS:
        raise ValueError(f"unknown quant {quant!r}; expected one of {', '.join(QUANTS)}")
    spec = dict(SHAPES[shape])
    spec["vocab_size"] = max(spec["vocab_size"], 49152)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), _ARCH[spec["family"]])
    _metadata(writer, spec, f"{shape}-random-{quant}")
    matrices = [
        (n, r, c, tensor_type(n, quant, spec["num_hidden_layers"], c))
        for n, r, c in _matrices(spec)
    ]
    vectors = _vectors(spec)
    for name, rows, cols, type_name in matrices:
        qtype = gguf.GGMLQuantizationType[type_name]
        elems, size = gguf.GGML_QUANT_SIZES[qtype]
        row_bytes = cols // elems * size
        # bytes: the writer turns them into the type's elements
        writer.add_tensor_info(
            name, (rows, row_bytes), np.dtype(np.uint8), rows * row_bytes, raw_dtype=qtype
        )
    for name, length, _ in vectors:
        writer.add_tensor_info(name, (length,), np.dtype(np.float32), 4 * length)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, rows, cols, type_name in matrices:
        writer.write_tensor_data(random_blocks(rows, cols, type_name, rng))
    for _, length, value in vectors:
        writer.write_tensor_data(np.full(length, value, dtype=np.float32))
    writer.close()
    return path
