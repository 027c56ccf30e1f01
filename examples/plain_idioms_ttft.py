"""TTFT full vs blend through the plain idioms, and background warmup's cost to a running query.

1. LlamaIndex ``Settings.llm = BlendLLM`` + ``index.as_query_engine()`` and the LangChain LCEL
   ``format_docs`` chain, over MuSiQue passages in a temporary Chroma, warmed at ingestion
   (canonical chunk context): per question, full and blend run back to back (interleaved).
2. Warmup interference: the same blend query while the warmup pool (a) is idle, (b) works
   through a backlog with ``pause_during_queries`` on, (c) off; interleaved per round.
Writes JSON (medians of per-question ratios) to ``--out``. Timings on a shared machine are noisy.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import load_passages, parse_args  # noqa: E402


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    import chromadb
    from langchain_chroma import Chroma
    from langchain_core.documents import Document as LCDocument
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough
    from langchain_ragblend import ChatRagBlend, MiniLMEmbeddings
    from llama_index.core import Document, Settings, StorageContext, VectorStoreIndex
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.llms.ragblend import BlendLLM, BlendWarmup, MiniLMEmbedding
    from llama_index.vector_stores.chroma import ChromaVectorStore

    from ragblend import BlendConfig, BlendEngine
    from ragblend.warmup import WarmupPool

    data, passages = load_passages(args.dataset, args.cases or args.questions)
    questions = [case["question"] for case in data[: args.questions]]
    engine = BlendEngine.from_pretrained(
        args.model, config=BlendConfig(precompute_context="canonical")
    )
    new = args.max_new_tokens
    li_llm = BlendLLM(engine=engine, max_new_tokens=new)
    Settings.llm, Settings.embed_model = li_llm, (embed := MiniLMEmbedding())
    collection = chromadb.PersistentClient(path=tempfile.mkdtemp()).get_or_create_collection("docs")
    index = VectorStoreIndex.from_documents(
        [Document(text=p["text"]) for p in passages],
        storage_context=StorageContext.from_defaults(vector_store=ChromaVectorStore(collection)),
        transformations=[SentenceSplitter(chunk_size=1024), embed, BlendWarmup(li_llm)],
    )
    li_llm.wait_for_warmup()
    query_engine = index.as_query_engine(similarity_top_k=args.top_k)

    lc_llm = ChatRagBlend(engine=engine, max_new_tokens=new)
    docs = [LCDocument(page_content=p["text"]) for p in passages]
    retriever = Chroma.from_documents(
        docs, MiniLMEmbeddings(), persist_directory=tempfile.mkdtemp()
    ).as_retriever(search_kwargs={"k": args.top_k})
    lc_llm.warm(docs)
    lc_llm.wait_for_warmup()
    prompt = ChatPromptTemplate.from_template(
        "Answer the question from the context.\nContext: {context}\nQuestion: {question}\nAnswer:"
    )
    chain = (
        {
            "context": retriever | (lambda ds: "\n\n".join(d.page_content for d in ds)),
            "question": RunnablePassthrough(),
        }
        | prompt
        | lc_llm
    )

    def li(mode: str, q: str) -> dict:
        li_llm.mode = mode
        query_engine.query(q)
        s = li_llm.last_stats
        return {"ttft_ms": s.ttft_ms, "mode": s.mode, "hits": s.chunk_hits}

    def lc(mode: str, q: str) -> dict:
        lc_llm.mode = mode
        meta = chain.invoke(q).response_metadata
        return {"ttft_ms": meta["ttft_ms"], "mode": meta["mode"], "hits": meta["chunk_hits"]}

    results: dict = {"machine": "shared 2-core CPU; noisy", "questions": len(questions)}
    for name, run in (("llamaindex_query_engine", li), ("langchain_lcel", lc)):
        rows = []
        for q in questions:
            full, blend = run("full", q), run("blend", q)
            rows.append(
                {
                    "question": q,
                    "full": full,
                    "blend": blend,
                    "speedup": full["ttft_ms"] / blend["ttft_ms"],
                }
            )
        results[name] = {
            "rows": rows,
            "median_speedup": statistics.median(r["speedup"] for r in rows),
        }
        print(
            name,
            "median TTFT speedup",
            round(results[name]["median_speedup"], 2),
            [
                (round(r["full"]["ttft_ms"]), round(r["blend"]["ttft_ms"]), r["blend"]["hits"])
                for r in rows
            ],
        )

    # warmup interference: blend query latency with an idle / busy-paused / busy-unpaused pool
    backlog = [f"{p['text']} (variant {i})" for i in range(40) for p in passages[:3]]
    li_llm.mode = "blend"
    ratios: dict[str, list[float]] = {"paused": [], "unpaused": []}
    for q in questions:
        timings = {}
        for variant in ("idle", "paused", "unpaused"):
            pool = WarmupPool(engine, pause_during_queries=variant == "paused")
            if variant != "idle":
                pool.warm(backlog[:20])
                backlog = backlog[20:]
                time.sleep(0.3)  # the worker is busy on the backlog
            li_llm._warmup = pool  # route the query's pause through this pool
            t0 = time.perf_counter()
            query_engine.query(q)
            timings[variant] = time.perf_counter() - t0
            li_llm._warmup = None
            pool.close(wait=False)
        for variant in ratios:
            ratios[variant].append(timings[variant] / timings["idle"])
    results["warmup_interference"] = {
        v: {"median_latency_ratio_vs_idle": statistics.median(r), "ratios": r}
        for v, r in ratios.items()
    }
    print(
        "warmup interference (query latency / idle):",
        {v: round(statistics.median(r), 2) for v, r in ratios.items()},
    )
    out = Path("out/plain_idioms_ttft.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print("wrote", out)


if __name__ == "__main__":
    main()
