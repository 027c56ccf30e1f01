"""LangChain integration for ragblend: CacheBlend chunk-KV fusion behind a chat model."""

from langchain_ragblend.callbacks import (
    BlendStatsCallbackHandler,
    KVWarmupCallbackHandler,
    add_documents,
    warm_documents,
)
from langchain_ragblend.chains import (
    blend_prompt_format,
    create_blend_retrieval_chain,
    create_blend_stuff_chain,
    default_blend_prompt,
    stuff_messages,
)
from langchain_ragblend.chat_models import ChatRagBlend, shared_engine
from langchain_ragblend.chunks import CHUNK_TAG, chunk_block, chunk_blocks, documents_message
from langchain_ragblend.embeddings import MiniLMEmbeddings
from langchain_ragblend.vectorstores import offline_chroma

__all__ = [
    "CHUNK_TAG",
    "BlendStatsCallbackHandler",
    "ChatRagBlend",
    "KVWarmupCallbackHandler",
    "MiniLMEmbeddings",
    "add_documents",
    "blend_prompt_format",
    "chunk_block",
    "chunk_blocks",
    "create_blend_retrieval_chain",
    "create_blend_stuff_chain",
    "default_blend_prompt",
    "documents_message",
    "offline_chroma",
    "shared_engine",
    "stuff_messages",
    "warm_documents",
]
__version__ = "0.1.0"
