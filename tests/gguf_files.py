"""Writing tiny GGUF files of each family from HF models (what llama.cpp's converter writes)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
GGUF_ARCH["gemma3"] = "gemma3"


def _tokenizer_fields() -> dict:
    """The embedded SmolLM2 GGUF's tokenizer (the tiny models share its vocabulary)."""
    import gguf

    from ragblend.models.loading import embedded_gguf_path

    reader = gguf.GGUFReader(embedded_gguf_path())
    return {k: reader.fields[k].contents() for k in reader.fields if k.startswith("tokenizer.ggml")}


def _llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for q/k of Llama-architecture files (its converter's permute)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_gguf(
    model, family: str, path: Path, half: bool = False, quant: str | dict[str, str] | None = None
) -> Path:
    """Write ``model`` (a tiny HF causal LM of ``family``) as a GGUF file at ``path``.

    ``half``: 2-D weights as F16 (norms and biases stay F32, as llama.cpp writes them).
    ``quant``: 2-D weights as that ggml type (a name, e.g. ``"Q8_0"``), or per matrix
    (``{"attn_q": "Q4_K", "token_embd": "Q8_0", ...}``, by GGUF base name; others F32).
    Types the ``gguf`` package quantizes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, TQ2_0) hold the
    model's weights quantized; the K-quants (Q4_K, Q5_K, Q6_K) hold random blocks instead
    (the ``gguf`` package has no K-quantizer): such a file is its own model."""
    import gguf

    cfg = model.config
    arch = GGUF_ARCH[family]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"{family}-tiny")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if family == "gemma3":
        writer.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
        writer.add_sliding_window(cfg.sliding_window)
    else:
        writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        writer.add_rope_dimension_count(head_dim)
    fields = _tokenizer_fields()
    writer.add_tokenizer_model(fields["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(fields["tokenizer.ggml.pre"])
    writer.add_token_list(fields["tokenizer.ggml.tokens"])
    writer.add_token_types(fields["tokenizer.ggml.token_type"])
    writer.add_token_merges(fields["tokenizer.ggml.merges"])
    writer.add_bos_token_id(fields["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(fields["tokenizer.ggml.eos_token_id"])

    names = gguf.get_tensor_name_map(
        next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), cfg.num_hidden_layers
    )
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        name = names.get_name(base)
        assert name is not None, hf_name
        w = tensor.detach().to(torch.float32).numpy().copy()
        if arch == "llama" and name.endswith(("attn_q", "attn_k")):
            w = _llama_permute(
                w, cfg.num_attention_heads if name.endswith("q") else cfg.num_key_value_heads
            )
        if family == "gemma3" and name.endswith("norm"):
            w = w + 1  # llama.cpp stores Gemma's norms as 1 + weight
        if half and w.ndim == 2:
            w = w.astype(np.float16)
        kind = quant if isinstance(quant, str) or quant is None else quant.get(name.split(".")[-1])
        if kind is not None and w.ndim == 2:
            w, raw = _quantized(w, kind)
            writer.add_tensor(f"{name}.{suffix}", w, raw_dtype=raw)
            continue
        writer.add_tensor(f"{name}.{suffix}", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _quantized(w: np.ndarray, kind: str):
    """(uint8 blocks [rows, row_bytes], ggml type) of ``w`` [rows, cols] as ``kind``."""
    import gguf

    from ragblend.bench.random_gguf import random_blocks

    qtype = gguf.GGMLQuantizationType[kind]
    if kind in ("Q4_K", "Q5_K", "Q6_K"):
        return random_blocks(w.shape[0], w.shape[1], kind, np.random.default_rng(0)), qtype
    return gguf.quantize(np.ascontiguousarray(w, dtype=np.float32), qtype), qtype
