"""RAG with LlamaIndex + ragblend: Chroma index, KV precompute at ingestion, blend vs full TTFT.

    python examples/llamaindex_rag.py [--dataset PATH] [--questions 3] [--top-k 6]

Indexes the MuSiQue dev passages (one node per passage) into a persistent Chroma collection
with offline all-MiniLM-L6-v2 embeddings; a ``BlendWarmup`` step in the ingestion pipeline
precomputes each passage's KV cache in the background. Each question is then answered through
the same kind of query engine by a CacheBlend ``BlendLLM`` and by a full-prefill one sharing
the model, printing answers, sources and time-to-first-token.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import COLLECTION, chroma_dir, load_passages, parse_args  # noqa: E402


def load_documents(path: Path, cases: int):
    """The dataset and one Document per distinct passage of the first ``cases`` (0: all)."""
    from llama_index.core import Document

    data, passages = load_passages(path, cases)
    docs = [
        Document(text=p["text"], metadata={"title": p["title"]} if p["title"] else {})
        for p in passages
    ]
    return data, docs


def chroma_store(persist_dir: Path):
    """A fresh Chroma collection in ``persist_dir``; Chroma's own embedder is never used."""
    import chromadb
    from chromadb.config import Settings as ChromaSettings
    from llama_index.vector_stores.chroma import ChromaVectorStore

    client = chromadb.PersistentClient(
        path=str(persist_dir), settings=ChromaSettings(anonymized_telemetry=False)
    )
    if COLLECTION in [c.name for c in client.list_collections()]:
        client.delete_collection(COLLECTION)
    collection = client.create_collection(COLLECTION, embedding_function=None)
    return ChromaVectorStore(chroma_collection=collection)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__.split("\n\n")[0], argv)
    import torch

    torch.set_num_threads(min(torch.get_num_threads(), os.cpu_count() or 1))
    from llama_index.core import VectorStoreIndex
    from llama_index.core.ingestion import IngestionPipeline
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.llms.ragblend import BlendLLM, BlendWarmup, MiniLMEmbedding, blend_query_engine

    data, docs = load_documents(args.dataset, args.questions if args.cases is None else args.cases)
    with chroma_dir(args.persist_dir) as persist_dir:
        t0 = time.perf_counter()
        llm = BlendLLM(args.model, ratio=args.ratio, max_new_tokens=args.max_new_tokens)
        full_llm = BlendLLM(engine=llm.engine, mode="full", max_new_tokens=args.max_new_tokens)
        embed = MiniLMEmbedding()
        print(
            f"model {llm.metadata.model_name} + all-MiniLM-L6-v2 loaded in "
            f"{time.perf_counter() - t0:.1f} s"
        )

        vector_store = chroma_store(persist_dir)
        pipeline = IngestionPipeline(
            transformations=[SentenceSplitter(chunk_size=1024), embed, BlendWarmup(llm)],
            vector_store=vector_store,
        )
        t0 = time.perf_counter()
        nodes = pipeline.run(documents=docs)
        t_ingest = time.perf_counter() - t0
        llm.wait_for_warmup()
        t_warm = time.perf_counter() - t0
        print(
            f"indexed {len(nodes)} nodes from {len(docs)} passages into Chroma at "
            f"{persist_dir} in {t_ingest:.1f} s; KV warmup done after {t_warm:.1f} s "
            f"({llm.warmup_queue.stored} chunks precomputed)"
        )

        index = VectorStoreIndex.from_vector_store(vector_store, embed_model=embed)
        modes = {  # full prefill first, then blend, per question
            "full": (full_llm, blend_query_engine(full_llm, index, similarity_top_k=args.top_k)),
            "blend": (llm, blend_query_engine(llm, index, similarity_top_k=args.top_k)),
        }
        ttft: dict[str, list[float]] = {name: [] for name in modes}
        for i, case in enumerate(data[: args.questions]):
            question = case["question"]
            print(f"\n[{i + 1}] {question}   (gold: {' | '.join(case['answers'])})")
            for name, (mode_llm, query_engine) in modes.items():
                response = query_engine.query(question)
                stats = mode_llm.last_stats
                ttft[name].append(stats.ttft_ms)
                extra = ""
                if name == "blend":
                    hits = f"{stats.chunk_hits}/{stats.chunk_hits + stats.chunk_misses}"
                    extra = f", chunk hits {hits}, recomputed {stats.recomputed_fraction:.0%}"
                print(
                    f"  {name:5s} TTFT {stats.ttft_ms:7.0f} ms ({stats.prompt_tokens} prompt "
                    f"tokens{extra}): {str(response).strip()!r}"
                )
            print("  sources:")
            for rank, node in enumerate(response.source_nodes, 1):
                text = node.node.get_content().replace("\n", " ")
                print(f"    {rank}. score {node.score:.3f}  {text[:90]}…")

        if ttft["full"]:
            med = {k: statistics.median(v) for k, v in ttft.items()}
            pairs = zip(ttft["full"], ttft["blend"], strict=True)
            speedup = statistics.median(f / b for f, b in pairs if b > 0)
            print(
                f"\nmedian TTFT over {len(ttft['full'])} questions: full {med['full']:.0f} ms, "
                f"blend {med['blend']:.0f} ms (median speedup {speedup:.2f}x)"
            )
        llm.close()
        full_llm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
