"""A LangChain RAG chain on plain ``ChatOpenAI`` pointed at ``ragblend serve``: it blends as is.

    ragblend serve --model embedded                      # in another terminal
    python examples/serve_langchain.py [--url http://127.0.0.1:8000] [--questions 3]

Indexes the MuSiQue dev passages into Chroma (offline all-MiniLM-L6-v2 embeddings, from
``langchain_ragblend.offline_chroma``) and precomputes their KV on the server
(``POST /v1/ragblend/chunks``; ``ragblend warmup`` into the server's store does the same). The
chain is the ordinary one — retriever | prompt | ``ChatOpenAI(base_url=...)`` — with no
ragblend code in it: the server finds the retrieved passages in the prompt text and blends
their cached KV. Each question runs in blend mode and, for comparison, with
``extra_body={"ragblend": {"mode": "full"}}``; the server's ``ragblend`` object (read from the
``x-ragblend`` response header) gives the mode that ran, its TTFT and the chunk hits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import httpx

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import COLLECTION, DEFAULT_DATASET, chroma_dir, load_passages  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the ragblend server")
    p.add_argument("--api-key", default=os.environ.get("RAGBLEND_API_KEY", "none"))
    p.add_argument("--dataset", type=Path, default=DEFAULT_DATASET, help="MuSiQue-format JSON")
    p.add_argument("--questions", type=int, default=3)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=24)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from langchain_core.documents import Document
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnableLambda, RunnablePassthrough
    from langchain_openai import ChatOpenAI
    from langchain_ragblend import offline_chroma

    headers = {"Authorization": f"Bearer {args.api_key}"}
    model = httpx.get(f"{args.url}/v1/models", headers=headers).json()["data"][0]["id"]
    data, passages = load_passages(args.dataset, args.questions)
    docs = [Document(page_content=p["text"], metadata={"title": p["title"]}) for p in passages]

    t0 = time.perf_counter()
    texts = {"texts": [d.page_content for d in docs]}
    warmed = httpx.post(f"{args.url}/v1/ragblend/chunks", json=texts, headers=headers, timeout=None)
    warmed.raise_for_status()
    print(f"server precomputed {len(docs)} passages in {time.perf_counter() - t0:.1f} s")

    prompt = ChatPromptTemplate.from_messages(
        [
            ("system", "Answer the question from the passages, in a few words."),
            ("human", "Passages:\n\n{context}\n\nQuestion: {question}"),
        ]
    )
    llm = ChatOpenAI(
        base_url=f"{args.url}/v1",
        api_key=args.api_key,
        model=model,
        temperature=0,
        max_tokens=args.max_tokens,
        include_response_headers=True,  # the server's ragblend object rides in x-ragblend
    )
    join = RunnableLambda(lambda ds: "\n\n".join(d.page_content for d in ds))
    with chroma_dir(None) as persist_dir:
        store = offline_chroma(persist_dir, collection_name=COLLECTION)
        store.add_documents(docs)
        retriever = store.as_retriever(search_kwargs={"k": args.top_k})
        chain = {"context": retriever | join, "question": RunnablePassthrough()} | prompt
        for case in data[: args.questions]:
            print(f"\nQ: {case['question']}  (gold: {case['answers'][0]})")
            for mode in ("blend", "full"):
                bound = llm.bind(extra_body={"ragblend": {"mode": mode}})
                reply = (chain | bound).invoke(case["question"])
                info = json.loads(reply.response_metadata["headers"]["x-ragblend"])
                print(
                    f"  {mode:5s} ran {info['mode']:5s} TTFT {info['ttft_ms']:8.1f} ms, "
                    f"{info['chunk_hits']} hits: {reply.content.strip()!r}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
