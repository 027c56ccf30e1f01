"""LlamaIndex integration for ragblend (CacheBlend: fused chunk KV caches for RAG)."""

from llama_index.llms.ragblend.embeddings import MiniLMEmbedding
from llama_index.llms.ragblend.llm import BlendLLM
from llama_index.llms.ragblend.prompts import qa_prompt_format
from llama_index.llms.ragblend.query_engine import (
    WarmingRetriever,
    blend_query_engine,
    blend_synthesizer,
)
from llama_index.llms.ragblend.synthesizer import BlendSynthesizer
from llama_index.llms.ragblend.warmup import BlendRetrievalHook, BlendWarmup

__all__ = [
    "BlendLLM",
    "BlendRetrievalHook",
    "BlendSynthesizer",
    "BlendWarmup",
    "MiniLMEmbedding",
    "WarmingRetriever",
    "blend_query_engine",
    "blend_synthesizer",
    "qa_prompt_format",
]
