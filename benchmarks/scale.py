"""TTFT (full vs blend), decode speed and memory of real architectures from 0.5B to 7B.

    python benchmarks/scale.py --shapes qwen2.5-0.5b,qwen2.5-1.5b,llama-3.2-3b,mistral-7b \\
        [--questions N] [--dtype auto] [--quant none|Q4_K_M|Q8_0] [--weights auto|dequantize] \\
        [--gguf-dir DIR] --out DIR

Each shape is a random-initialised model of that architecture's real config
(``ragblend.bench.shapes``; no weights are downloaded), run in a process of its own so its peak
RSS is its own. Per question: 6 MuSiQue dev chunks of ≤512 tokens (the embedded tokenizer's ids;
a smaller vocabulary is widened to the tokenizer's) are precomputed, then full and blend
prefill are timed back to back (``--repeats`` each, the median kept), and decoding is timed for
``--decode-tokens`` tokens after the blend prefill (EOS ignored). Random weights give true
compute timings, not answers. Writes ``DIR/scale.json``:
``{"settings": {...}, "shapes": {shape: {"params", "dtype", "weights_bytes", "kv_bytes",
"ttft_full_ms", "ttft_blend_ms", "speedup", "decode_tok_s", "peak_rss_bytes"}}}``.

``--quant Q4_K_M`` (or ``Q8_0``) writes each shape's random weights as a real GGUF of that
type first (``ragblend.bench.random_gguf``, llama.cpp's per-tensor mix; kept under
``--gguf-dir`` when given, else deleted after) and runs the file with ``--weights``; each entry
then adds ``quant``, and ``weights_bytes`` is the weights' resident bytes as run. Where
llama-cpp-python is importable, each entry adds llama.cpp on the same file, prompt ids and
threads: ``llamacpp_ttft_full_ms`` (a full prefill) and ``llamacpp_decode_tok_s`` (after the
full prefill; ragblend's rate is after the blend prefill of the same prompt), measured after
ragblend's ``peak_rss_bytes`` is read.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ragblend.bench.random_gguf import QUANTS, write_random_gguf
from ragblend.bench.shapes import SHAPES
from ragblend.bench.shapes import build_model as build_shape
from ragblend.models.gguf import WEIGHTS

DATASET = Path(__file__).resolve().parents[2] / "shared" / "data" / "musique_dev.json"

# The embedded tokenizer's ids index every shape's embedding: a smaller vocabulary (Mistral's
# 32k, the tiny shape's) is widened to it. The rest of each shape is its architecture's own.
TOKENIZER_VOCAB = 49152


def build_model(shape: str, dtype, device: str = "cpu"):
    """A random-initialised causal LM of ``shape`` (``ragblend.bench.shapes``), created directly
    in ``dtype`` (on the ``meta`` device: its shapes only)."""
    import torch

    vocab = max(SHAPES[shape]["vocab_size"], TOKENIZER_VOCAB)
    return build_shape(shape, torch.device(device), dtype, seed=0, vocab_size=vocab)


def does_not_fit(shape: str, dtype_name: str, gguf: Path | None = None) -> str | None:
    """Why ``shape``'s weights in that dtype (or its GGUF file, kept quantized) cannot run here
    (over 80 % of the memory available now: the KV, activations and the process need the
    rest), or None."""
    from ragblend.models.dtype import resolve_dtype
    from ragblend.models.packed import available_memory

    dtype = resolve_dtype(dtype_name)
    if gguf is not None:
        weights, what = gguf.stat().st_size, f"{gguf.name}'s"
    else:
        model = build_model(shape, dtype, device="meta")
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        what = f"{str(dtype).removeprefix('torch.')}"
    free = available_memory()
    if free is None or weights <= 0.8 * free:
        return None
    gib = f"{weights / 2**30:.1f} GiB of {what} weights"
    return f"{gib} do not fit in the {free / 2**30:.1f} GiB available"


def measure(args: argparse.Namespace) -> dict:
    """One shape, in this process."""
    from transformers import AutoTokenizer

    from ragblend import BlendConfig, BlendEngine, SamplingParams
    from ragblend.bench.datasets import load_cases
    from ragblend.decode.generation import decode_tokens
    from ragblend.models.dtype import resolve_dtype
    from ragblend.models.loading import embedded_model_dir
    from ragblend.models.quantized import quantized_weights, weight_bytes

    dtype = resolve_dtype(args.dtype)
    config = BlendConfig(dtype=str(dtype).removeprefix("torch."), weights=args.weights)
    if args.gguf:
        engine = BlendEngine.from_pretrained(args.gguf, config=config)
        model, tokenizer = engine.model, engine.tokenizer
    else:
        model = build_model(args.worker, dtype)
        tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
        engine = BlendEngine(model, tokenizer, config, name=args.worker)
    cases = load_cases(args.dataset, tokenizer, 6, 512, args.questions)
    full_ms, blend_ms, ratios, rates, kv, prompts = [], [], [], [], [], []
    for case in cases:
        engine.precompute(case.chunks)
        prompt = engine.tokenize(case.question, case.chunks)
        prompts.append(list(prompt.ids))
        kv.append(engine.layers.kv_bytes_per_token() * len(prompt))
        engine.prefill(prompt, "blend")  # warm the code paths
        full_runs, blend_runs = [], []
        for _ in range(args.repeats):
            full_runs.append(engine.prefill(prompt, "full").stats.ttft_ms)
            blend = engine.prefill(prompt, "blend")
            blend_runs.append(blend.stats.ttft_ms)
        full_ms.append(statistics.median(full_runs))
        blend_ms.append(statistics.median(blend_runs))
        ratios.append(full_ms[-1] / blend_ms[-1])
        engine.prepare_decode()
        t0 = time.perf_counter()
        greedy, steps = SamplingParams(), args.decode_tokens + 1
        tokens = decode_tokens(model, blend, greedy, steps, set(), engine.layers, engine.native)
        count = sum(1 for _ in tokens) - 1  # the first token comes from the prefill
        rates.append(count / (time.perf_counter() - t0))
    quantized = quantized_weights(model)
    result = {
        "params": sum(p.numel() for p in model.parameters())
        + sum(w.rows * w.cols for w in {id(w.blocks): w for w in quantized.values()}.values()),
        "dtype": str(dtype).removeprefix("torch."),
        "weights_bytes": weight_bytes(model),
        "kv_bytes": int(statistics.median(kv)),
        "ttft_full_ms": statistics.median(full_ms),
        "ttft_blend_ms": statistics.median(blend_ms),
        "speedup": statistics.median(ratios),
        "decode_tok_s": statistics.median(rates),
        "decode_path": engine.decode_path,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "n": len(cases),
        "recomputed_fraction": blend.stats.recomputed_fraction,
    }
    if args.gguf:
        result["quant"] = args.quant
        result.update(llamacpp(args, prompts))
    return result


def llamacpp(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    """llama.cpp's full-prefill TTFT and decode rate on the same file and prompt ids (median
    over questions), or the reason it was skipped."""
    import torch

    from ragblend.bench import llamacpp as peer

    if not peer.available():
        return {"llamacpp_skipped": "llama-cpp-python is not installed"}
    n_ctx = max(len(p) for p in prompts) + args.decode_tokens + 16
    # the best of ragblend.bench.llamacpp's four settings on the embedded model on AVX2 and AMX
    # (benchmarks/results/*/bench_llamacpp): tuning per shape would cost minutes of prefills
    setting = peer.PeerSetting(n_batch=512, flash_attn=True)
    llm = peer.LlamaCppPeer(args.gguf, n_ctx, setting, threads=torch.get_num_threads())
    try:
        llm.ttft_ms(prompts[0][:64])  # warm-up
        ttft, rates = [], []
        for p in prompts:  # each decode goes on from the prompt's last timed prefill
            ttft.append(statistics.median(llm.ttft_ms(p)[0] for _ in range(args.repeats)))
            rates.append(llm.decode_tok_s(p, args.decode_tokens))
    finally:
        llm.close()
    return {
        "llamacpp_ttft_full_ms": statistics.median(ttft),
        "llamacpp_decode_tok_s": statistics.median(rates),
        "llamacpp_setting": {
            "n_batch": setting.n_batch,
            "flash_attn": setting.flash_attn,
            "use_extra_bufts": peer.use_extra_buffer_types(),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-1.5b,llama-3.2-3b,mistral-7b")
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quant", default="none", choices=("none", *QUANTS))
    parser.add_argument("--weights", default="auto", choices=WEIGHTS)
    parser.add_argument("--gguf-dir", help="where --quant's GGUF files are written and reused")
    parser.add_argument("--gguf", help=argparse.SUPPRESS)  # the worker's GGUF
    parser.add_argument("--dataset", default=str(DATASET))
    parser.add_argument("--out", help="output directory (scale.json)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # one shape, in this process
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        Path(args.result).write_text(json.dumps(measure(args)))
        return
    if not args.out:
        parser.error("--out is required")
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}; known: {', '.join(SHAPES)}")
    import torch

    from ragblend.cpu import describe

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "settings": {
            "dtype": args.dtype,
            "quant": args.quant,
            "weights": args.weights,
            "questions": args.questions,
            "repeats": args.repeats,
            "decode_tokens": args.decode_tokens,
            "top_k": 6,
            "chunk_tokens": 512,
            "torch_threads": torch.get_num_threads(),
            **describe(),
        },
        "shapes": {},
    }
    gguf_dir = Path(args.gguf_dir or tempfile.mkdtemp(prefix="ragblend-scale-"))
    for shape in shapes:
        gguf = None
        if args.quant != "none":
            gguf = gguf_dir / f"{shape}-{args.quant}.gguf"
            if not gguf.is_file():
                print(shape, "writing", gguf, flush=True)
                write_random_gguf(shape, args.quant, gguf)
        reason = does_not_fit(shape, args.dtype, gguf)
        if reason is not None:
            results["shapes"][shape] = {"skipped": reason}
            print(shape, "skipped:", reason, flush=True)
        else:
            results["shapes"][shape] = run_worker(args, shape, gguf)
            print(shape, json.dumps(results["shapes"][shape]), flush=True)
        if gguf is not None and not args.gguf_dir:
            gguf.unlink()
        (out / "scale.json").write_text(json.dumps(results, indent=2))


def run_worker(args: argparse.Namespace, shape: str, gguf: Path | None) -> dict:
    """Measure ``shape`` in a process of its own."""
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        cmd = [sys.executable, __file__, "--worker", shape, "--result", result.name]
        for flag in (
            "questions",
            "repeats",
            "decode_tokens",
            "dtype",
            "dataset",
            "quant",
            "weights",
        ):
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        if gguf is not None:
            cmd += ["--gguf", str(gguf)]
        proc = subprocess.run(cmd)
        if proc.returncode != 0:
            return {"error": f"exit status {proc.returncode}"}
        return json.loads(Path(result.name).read_text())


if __name__ == "__main__":
    main()
