"""RAG with LangChain + ragblend: Chroma retriever | blend stuff chain, blend vs full TTFT.

    python examples/langchain_rag.py [--dataset PATH] [--questions 3] [--top-k 6]

Indexes the MuSiQue dev passages (one Document per passage) into a persistent Chroma store with
offline all-MiniLM-L6-v2 embeddings; ``add_documents`` also enqueues each passage's KV
precompute in the background, and a ``KVWarmupCallbackHandler`` on the chain enqueues any
retrieved passage still missing. Each question then goes through ``retriever | blend stuff
chain`` with CacheBlend and with the same chain in full-prefill mode, printing answers,
sources and time-to-first-token.
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
    from langchain_core.documents import Document

    data, passages = load_passages(path, cases)
    docs = [
        Document(
            page_content=p["text"],
            metadata={"case": p["case"], "ctx": p["ctx"], "title": p["title"]},
        )
        for p in passages
    ]
    return data, docs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__.split("\n\n")[0], argv)
    import torch

    torch.set_num_threads(min(torch.get_num_threads(), os.cpu_count() or 1))
    from langchain_ragblend import (
        BlendStatsCallbackHandler,
        ChatRagBlend,
        KVWarmupCallbackHandler,
        add_documents,
        create_blend_retrieval_chain,
        offline_chroma,
    )

    data, docs = load_documents(args.dataset, args.questions if args.cases is None else args.cases)
    with chroma_dir(args.persist_dir) as persist_dir:
        t0 = time.perf_counter()
        llm = ChatRagBlend(model=args.model, ratio=args.ratio, max_new_tokens=args.max_new_tokens)
        store = offline_chroma(persist_dir, collection_name=COLLECTION)
        store.reset_collection()  # rebuild: the same passages would otherwise be added twice
        retriever = store.as_retriever(search_kwargs={"k": args.top_k})
        # retriever | blend stuff chain -> {"input", "context", "answer"}; full = same, mode="full"
        chains = {
            "full": create_blend_retrieval_chain(retriever, llm.bind(mode="full")),
            "blend": create_blend_retrieval_chain(retriever, llm),
        }
        print(
            f"model {llm.model_name} + all-MiniLM-L6-v2 loaded in {time.perf_counter() - t0:.1f} s"
        )

        t0 = time.perf_counter()
        add_documents(store, docs, llm)  # index, and precompute each passage's KV in background
        t_ingest = time.perf_counter() - t0
        llm.wait_for_warmup()
        t_warm = time.perf_counter() - t0
        print(
            f"indexed {len(docs)} passages into Chroma at {persist_dir} in {t_ingest:.1f} s; "
            f"KV warmup done after {t_warm:.1f} s"
        )

        warm = KVWarmupCallbackHandler(llm)
        stats = BlendStatsCallbackHandler()
        config = {"callbacks": [warm, stats]}
        ttft: dict[str, list[float]] = {"blend": [], "full": []}
        for i, case in enumerate(data[: args.questions]):
            question = case["question"]
            print(f"\n[{i + 1}] {question}   (gold: {' | '.join(case['answers'])})")
            for name, chain in chains.items():
                out = chain.invoke({"input": question}, config=config)
                rec = stats.last
                ttft[name].append(rec["ttft_ms"])
                extra = ""
                if name == "blend":
                    hits, misses = rec["chunk_hits"], rec["chunk_misses"]
                    extra = (
                        f", chunk hits {hits}/{hits + misses}, "
                        f"recomputed {rec['recomputed_fraction']:.0%}"
                    )
                print(
                    f"  {name:5s} TTFT {rec['ttft_ms']:7.0f} ms "
                    f"({rec['usage']['input_tokens']} prompt tokens{extra}): "
                    f"{out['answer'].strip()!r}"
                )
            print("  sources:")
            for rank, doc in enumerate(out["context"], 1):
                text = doc.page_content.replace("\n", " ")
                print(
                    f"    {rank}. case {doc.metadata['case']} ctx {doc.metadata['ctx']}  "
                    f"{text[:80]}…"
                )

        med = {k: statistics.median(v) for k, v in ttft.items()}
        speedups = [f / b for f, b in zip(ttft["full"], ttft["blend"], strict=True) if b > 0]
        print(
            f"\nmedian TTFT over {len(ttft['full'])} questions: full {med['full']:.0f} ms, "
            f"blend {med['blend']:.0f} ms (median speedup {statistics.median(speedups):.2f}x); "
            f"the warmup callback enqueued {len(warm.enqueued)} missing passages"
        )
        llm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
