"""``BlendLLM``: the LlamaIndex LLM users construct, with its deprecated query-engine aliases.

The LLM itself is :class:`~llama_index.llms.ragblend.base.BaseBlendLLM`; the synthesizer and the
query-engine factory build on that, and this class adds the two methods that call them
(``as_query_engine``, ``synthesizer``: kept as deprecated aliases since 0.1.0).
"""

from __future__ import annotations

import warnings
from typing import Any

from llama_index.core.indices.base import BaseIndex
from llama_index.core.query_engine import RetrieverQueryEngine

from llama_index.llms.ragblend.base import BaseBlendLLM
from llama_index.llms.ragblend.query_engine import blend_query_engine, blend_synthesizer
from llama_index.llms.ragblend.synthesizer import BlendSynthesizer


class BlendLLM(BaseBlendLLM):
    __doc__ = BaseBlendLLM.__doc__

    def as_query_engine(self, index: BaseIndex, **kwargs: Any) -> RetrieverQueryEngine:
        """Deprecated since 0.1.0: use ``blend_query_engine(llm, index, ...)``
        (:mod:`llama_index.llms.ragblend.query_engine`), which this calls."""
        warnings.warn(
            "BlendLLM.as_query_engine(index, ...) is deprecated; use "
            "llama_index.llms.ragblend.blend_query_engine(llm, index, ...)",
            DeprecationWarning,
            stacklevel=2,
        )
        return blend_query_engine(self, index, **kwargs)

    def synthesizer(self, **kwargs: Any) -> BlendSynthesizer:
        """Deprecated since 0.1.0: use ``blend_synthesizer(llm, ...)``
        (:mod:`llama_index.llms.ragblend.query_engine`), which this calls."""
        warnings.warn(
            "BlendLLM.synthesizer(...) is deprecated; use "
            "llama_index.llms.ragblend.blend_synthesizer(llm, ...)",
            DeprecationWarning,
            stacklevel=2,
        )
        return blend_synthesizer(self, **kwargs)
