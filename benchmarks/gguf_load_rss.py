"""Peak RSS of loading a 7B-shaped F16 GGUF file that this script writes itself.

    python benchmarks/gguf_load_rss.py [--shape mistral-7b] [--dtype bfloat16] --out DIR

Writes a GGUF file of the shape (the layers of its config in ``ragblend.bench.shapes``, the embedded
model's tokenizer and so its vocabulary; F16 weights, F32 norms, as llama.cpp writes them)
tensor by tensor into a temporary directory — never the whole model in memory — then loads
it (``ragblend.models.loading.load_model``, tensor by tensor from the mapped file) in a child
process and writes ``DIR/gguf_load.json``: ``gguf_bytes``, ``loaded_bytes`` (the model's
weights as loaded), ``peak_rss_bytes`` (the child's), ``seconds``, and ``within_target`` (peak
RSS ≤ loaded size + 1 GiB). The weights are a tiled random pattern: loading does not depend on
the values.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ragblend.bench.shapes import SHAPES

GIB = 1 << 30
FAMILY_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}  # llama.cpp's names


def tensors(family: str, config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """GGUF tensor names and numpy shapes of a Llama-layout model (Qwen2: q/k/v biases)."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    inter, vocab = config["intermediate_size"], config["vocab_size"]
    out = [("token_embd.weight", (vocab, hidden))]
    for i in range(layers):
        b = f"blk.{i}"
        out += [
            (f"{b}.attn_norm.weight", (hidden,)),
            (f"{b}.attn_q.weight", (heads * head_dim, hidden)),
            (f"{b}.attn_k.weight", (kv_heads * head_dim, hidden)),
            (f"{b}.attn_v.weight", (kv_heads * head_dim, hidden)),
            (f"{b}.attn_output.weight", (hidden, heads * head_dim)),
            (f"{b}.ffn_norm.weight", (hidden,)),
            (f"{b}.ffn_gate.weight", (inter, hidden)),
            (f"{b}.ffn_up.weight", (inter, hidden)),
            (f"{b}.ffn_down.weight", (hidden, inter)),
        ]
        if family == "qwen2":
            out += [
                (f"{b}.attn_q.bias", (heads * head_dim,)),
                (f"{b}.attn_k.bias", (kv_heads * head_dim,)),
                (f"{b}.attn_v.bias", (kv_heads * head_dim,)),
            ]
    out.append(("output_norm.weight", (hidden,)))
    if not config.get("tie_word_embeddings"):
        out.append(("output.weight", (vocab, hidden)))
    return out


def write_gguf(shape: str, path: Path) -> int:
    """Write ``shape`` as a GGUF file at ``path``, one tensor in memory at a time; its size."""
    import gguf

    from ragblend.models.loading import embedded_gguf_path

    family, config = SHAPES[shape]["family"], SHAPES[shape]
    reader = gguf.GGUFReader(embedded_gguf_path())
    fields = {k: reader.fields[k].contents() for k in reader.fields if k.startswith("tokenizer")}
    config = {**config, "vocab_size": len(fields["tokenizer.ggml.tokens"])}
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads

    writer = gguf.GGUFWriter(str(path), FAMILY_ARCH[family])
    writer.add_name(f"{shape}-shaped")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    writer.add_rope_dimension_count(head_dim)
    writer.add_tokenizer_model(fields["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(fields["tokenizer.ggml.pre"])
    writer.add_token_list(fields["tokenizer.ggml.tokens"])
    writer.add_token_types(fields["tokenizer.ggml.token_type"])
    writer.add_token_merges(fields["tokenizer.ggml.merges"])
    writer.add_bos_token_id(fields["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(fields["tokenizer.ggml.eos_token_id"])

    plan = tensors(family, config)
    for name, dims in plan:
        dtype = np.float32 if len(dims) == 1 else np.float16
        nbytes = int(np.prod(dims)) * np.dtype(dtype).itemsize
        writer.add_tensor_info(name, dims, np.dtype(dtype), nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    pattern = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32) * 0.02
    for _name, dims in plan:
        if len(dims) == 1:
            writer.write_tensor_data(np.ones(dims, dtype=np.float32))
        else:
            writer.write_tensor_data(np.resize(pattern.astype(np.float16), dims))
    writer.close()
    return path.stat().st_size


LOAD = (
    "import json, sys; from ragblend.models.loading import load_model; "
    "from ragblend.models.quantized import weight_bytes; "
    "model, _ = load_model(sys.argv[1], dtype=sys.argv[2]); print(json.dumps(weight_bytes(model)))"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="mistral-7b", choices=sorted(SHAPES))
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--work", type=Path, default=None, help="where to write the files")
    parser.add_argument("--dtype", default="bfloat16", help="the compute dtype loaded into")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ragblend-gguf-rss-", dir=args.work) as tmp:
        source = Path(tmp) / f"{args.shape}.gguf"
        t0 = time.perf_counter()
        gguf_bytes = write_gguf(args.shape, source)
        written_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        child = [sys.executable, "-c", LOAD, str(source), args.dtype]
        out = subprocess.run(child, check=True, capture_output=True, text=True).stdout
        seconds = time.perf_counter() - t0
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        loaded = int(out.strip().splitlines()[-1])
    result = {
        "shape": args.shape,
        "gguf_bytes": gguf_bytes,
        "write_seconds": written_s,
        "dtype": args.dtype,
        "loaded_bytes": loaded,
        "peak_rss_bytes": peak,
        "seconds": seconds,
        "target_bytes": loaded + GIB,
        "within_target": peak <= loaded + GIB,
    }
    (args.out / "gguf_load.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
