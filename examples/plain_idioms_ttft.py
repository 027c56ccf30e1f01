"""TTFT full vs blend through each idiom users already know (the table of issue 10).

MuSiQue passages in a temporary Chroma, KV warmed at ingestion (LlamaIndex ``BlendWarmup``
with ``escaped_forms=True`` for ``simple_summarize``, LangChain ``add_documents``), canonical
chunk context. For each idiom and question, a full-prefill run and a blend run go back to back
(interleaved); the table reports chunk hits / chunks found and the median of the per-question
TTFT ratios. The last row ingests into an empty store and queries at once, without waiting for
warmup. Writes ``out/plain_idioms_ttft.json`` and prints a markdown table. Timings on a shared
machine are indicative only; hits and modes are exact.

    python examples/plain_idioms_ttft.py --cases 2 --questions 3 --top-k 6
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import load_passages, parse_args  # noqa: E402

QUESTION_FIRST = (
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved "
    "context to answer the question.\nQuestion: {question}\nContext: {context}\nAnswer:"
)


def llamaindex_idioms(engine, passages, top_k, new_tokens, escaped_forms=True):
    """(name, run(mode, question) -> stats) for the LlamaIndex idioms, after ingestion."""
    import chromadb
    from llama_index.core import Document, Settings, StorageContext, VectorStoreIndex
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.core.prompts import PromptTemplate
    from llama_index.llms.ragblend import BlendLLM, BlendWarmup, MiniLMEmbedding
    from llama_index.llms.ragblend.query_engine import blend_query_engine
    from llama_index.vector_stores.chroma import ChromaVectorStore

    llm = BlendLLM(engine=engine, max_new_tokens=new_tokens)
    Settings.llm, Settings.embed_model = llm, (embed := MiniLMEmbedding())
    client = chromadb.PersistentClient(path=tempfile.mkdtemp())
    collection = client.get_or_create_collection("docs")
    index = VectorStoreIndex.from_documents(
        [Document(text=p["text"], metadata={"title": p["title"]}) for p in passages],
        storage_context=StorageContext.from_defaults(vector_store=ChromaVectorStore(collection)),
        transformations=[
            SentenceSplitter(chunk_size=1024),
            embed,
            BlendWarmup(llm, escaped_forms=escaped_forms),
        ],
    )

    def stats() -> dict:
        s = llm.last_stats
        found = s.chunk_hits + s.chunk_misses
        return {
            "ttft_ms": s.ttft_ms,
            "mode": s.mode,
            "hits": s.chunk_hits,
            "found": found,
            "prompt_tokens": s.prompt_tokens,
        }

    def plain(**kwargs) -> Callable[[str, str], dict]:
        query_engine = index.as_query_engine(llm=llm, similarity_top_k=top_k, **kwargs)

        def run(mode: str, question: str) -> dict:
            llm.mode = mode
            response = query_engine.query(question)
            if kwargs.get("streaming"):
                "".join(response.response_gen)
            return stats()

        return run

    def aquery(mode: str, question: str) -> dict:
        llm.mode = mode
        asyncio.run(index.as_query_engine(llm=llm, similarity_top_k=top_k).aquery(question))
        return stats()

    documented = blend_query_engine(llm, index, similarity_top_k=top_k)

    def factory(mode: str, question: str) -> dict:
        llm.mode = mode
        documented.query(question)
        return stats()

    question_first = PromptTemplate(
        "Question: {query_str}\nAnswer using only these passages.\n{context_str}\nAnswer:"
    )
    idioms = [
        ("LlamaIndex `blend_query_engine(llm, index)` (documented)", factory),
        ("`Settings.llm = BlendLLM`; `index.as_query_engine()` (compact)", plain()),
        ("… `as_query_engine(streaming=True)`", plain(streaming=True)),
        ("… `aquery`", aquery),
        ("… `response_mode='simple_summarize'`", plain(response_mode="simple_summarize")),
        ("… question-first `text_qa_template`", plain(text_qa_template=question_first)),
    ]
    return llm, idioms


def langchain_idioms(engine, passages, top_k, new_tokens):
    """(name, run(mode, question) -> stats) for the LangChain idioms, after add_documents."""
    from langchain_classic.chains import create_retrieval_chain
    from langchain_classic.chains.combine_documents import create_stuff_documents_chain
    from langchain_core.documents import Document
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough
    from langchain_ragblend import (
        BlendStatsCallbackHandler,
        ChatRagBlend,
        add_documents,
        create_blend_retrieval_chain,
        offline_chroma,
    )

    llm = ChatRagBlend(engine=engine, max_new_tokens=new_tokens)
    store = offline_chroma(tempfile.mkdtemp())
    add_documents(store, [Document(page_content=p["text"]) for p in passages], llm)
    retriever = store.as_retriever(search_kwargs={"k": top_k})

    def format_docs(docs: list[Document]) -> str:
        return "\n\n".join(doc.page_content for doc in docs)

    def lcel(template: str):
        prompt = ChatPromptTemplate.from_template(template)
        return {"context": retriever | format_docs, "question": RunnablePassthrough()} | (
            prompt | llm
        )

    tutorial = lcel(
        "Answer the question from the context.\nContext: {context}\nQuestion: {question}\nAnswer:"
    )
    stuff_prompt = ChatPromptTemplate.from_messages(
        [("system", "Answer from this context:\n\n{context}"), ("human", "{input}")]
    )
    classic = create_retrieval_chain(retriever, create_stuff_documents_chain(llm, stuff_prompt))

    def runner(chain, as_dict: bool = False, how: str = "invoke"):
        def run(mode: str, question: str) -> dict:
            llm.mode = mode
            handler = BlendStatsCallbackHandler()
            config = {"callbacks": [handler]}
            arg = {"input": question} if as_dict else question
            if how == "stream":
                for _ in chain.stream(arg, config=config):
                    pass
            elif how == "ainvoke":
                asyncio.run(chain.ainvoke(arg, config=config))
            else:
                chain.invoke(arg, config=config)
            meta = handler.last
            found = meta["chunk_hits"] + meta["chunk_misses"]
            return {
                "ttft_ms": meta["ttft_ms"],
                "mode": meta["mode"],
                "hits": meta["chunk_hits"],
                "found": found,
                "prompt_tokens": meta["usage"].get("input_tokens"),
            }

        return run

    idioms = [
        (
            "LangChain `create_blend_retrieval_chain` (documented)",
            runner(create_blend_retrieval_chain(retriever, llm), as_dict=True),
        ),
        ("LCEL tutorial chain (`retriever \\| format_docs`)", runner(tutorial)),
        ("… `.stream`", runner(tutorial, how="stream")),
        ("… `.ainvoke`", runner(tutorial, how="ainvoke")),
        (
            "classic `create_stuff_documents_chain` + `create_retrieval_chain`",
            runner(classic, as_dict=True),
        ),
        ("question-first template (hub rag-prompt)", runner(lcel(QUESTION_FIRST))),
    ]
    return llm, idioms


def measure(run, questions: list[str], top_k: int) -> dict:
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
    return {
        "rows": rows,
        "hits": sum(r["blend"]["hits"] for r in rows),
        "found": sum(r["blend"]["found"] for r in rows),
        "retrieved": top_k * len(rows),
        "blend_modes": sorted({r["blend"]["mode"] for r in rows}),
        "median_speedup": statistics.median(r["speedup"] for r in rows),
        "full_ttft_ms_median": statistics.median(r["full"]["ttft_ms"] for r in rows),
        "blend_ttft_ms_median": statistics.median(r["blend"]["ttft_ms"] for r in rows),
        "prompt_tokens_median": statistics.median(r["full"]["prompt_tokens"] for r in rows),
    }


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    from ragblend import BlendConfig, BlendEngine
    from ragblend.store.memory import MemoryStore

    data, passages = load_passages(args.dataset, args.cases or args.questions)
    questions = [case["question"] for case in data[: args.questions]]
    engine = BlendEngine.from_pretrained(
        args.model, config=BlendConfig(precompute_context="canonical")
    )
    new, k = args.max_new_tokens, args.top_k
    li_llm, li = llamaindex_idioms(engine, passages, k, new)
    lc_llm, lc = langchain_idioms(engine, passages, k, new)
    li_llm.wait_for_warmup()
    lc_llm.wait_for_warmup()

    results: dict = {
        "machine": f"{os.cpu_count()}-core CPU; TTFT is comparable only on a quiet machine",
        "load_average_at_start": os.getloadavg(),
        "passages": len(passages),
        "questions": len(questions),
        "top_k": k,
        "idioms": {},
    }
    for name, run in li + lc:
        try:
            results["idioms"][name] = measure(run, questions, k)
        except Exception as exc:  # a row that does not run is a result too
            results["idioms"][name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(name, json.dumps(results["idioms"][name].get("median_speedup")), flush=True)

    # ingest into an empty store and query at once: warmup still running
    cold = engine.with_config(store=MemoryStore(engine.config.ram_bytes))
    cold_llm, cold_idioms = llamaindex_idioms(cold, passages, k, new, escaped_forms=False)
    name = "`index.as_query_engine()` right after ingestion (no wait)"
    results["idioms"][name] = measure(dict(cold_idioms)[li[1][0]], questions, k)
    cold_llm.close()
    li_llm.close()
    lc_llm.close()

    lines = ["| idiom | runs | blends (hits / found / retrieved) | TTFT full → blend (ms) |"]
    lines.append("|---|---|---|---|")
    for name, r in results["idioms"].items():
        if "error" in r:
            lines.append(f"| {name} | no: {r['error']} | – | – |")
            continue
        lines.append(
            f"| {name} | yes | {r['hits']}/{r['found']}/{r['retrieved']} "
            f"(mode {', '.join(r['blend_modes'])}) | {r['full_ttft_ms_median']:.0f} → "
            f"{r['blend_ttft_ms_median']:.0f}, {r['median_speedup']:.1f}× |"
        )
    results["load_average_at_end"] = os.getloadavg()
    table = "\n".join(lines)
    results["table"] = table
    out = Path("out/plain_idioms_ttft.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(table)
    print("wrote", out)


if __name__ == "__main__":
    main()
