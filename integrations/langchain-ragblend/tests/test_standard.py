"""LangChain's standard chat-model suites (langchain-tests) against ChatRagBlend."""

from __future__ import annotations

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from langchain_ragblend import ChatRagBlend

pytestmark = pytest.mark.slow

PARAMS = {"model": "embedded", "max_new_tokens": 16}


class _Capabilities:
    """What ChatRagBlend supports: plain text chat only (no tools, structured output, images)."""

    @property
    def chat_model_class(self) -> type[ChatRagBlend]:
        return ChatRagBlend

    @property
    def chat_model_params(self) -> dict:
        return dict(PARAMS)

    @property
    def has_tool_calling(self) -> bool:
        return False

    @property
    def has_tool_choice(self) -> bool:
        return False

    @property
    def has_structured_output(self) -> bool:
        return False

    @property
    def supports_json_mode(self) -> bool:
        return False

    @property
    def supports_image_inputs(self) -> bool:
        return False

    @property
    def supports_image_urls(self) -> bool:
        return False

    @property
    def supports_pdf_inputs(self) -> bool:
        return False

    @property
    def supports_audio_inputs(self) -> bool:
        return False

    @property
    def supports_video_inputs(self) -> bool:
        return False

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supports_anthropic_inputs(self) -> bool:
        return False

    @property
    def supports_image_tool_message(self) -> bool:
        return False

    @property
    def supports_pdf_tool_message(self) -> bool:
        return False


class TestChatRagBlendUnit(_Capabilities, ChatModelUnitTests):
    pass


class TestChatRagBlendIntegration(_Capabilities, ChatModelIntegrationTests):
    pass
