"""The optional llama.cpp peer: a clear error without it; with it, a cleared-cache prefill."""

from __future__ import annotations

import pytest

from ragblend.bench import llamacpp
from ragblend.errors import RagblendError


@pytest.mark.skipif(llamacpp.available(), reason="llama-cpp-python is installed")
def test_peer_without_llama_cpp_is_a_clear_error(tmp_path):
    with pytest.raises(RagblendError, match="llama-cpp-python is not installed"):
        llamacpp.LlamaCppPeer(tmp_path / "x.gguf", 64, llamacpp.PeerSetting(512, False))


@pytest.mark.slow
@pytest.mark.skipif(not llamacpp.available(), reason="llama-cpp-python not installed")
def test_peer_prefill_from_a_cleared_cache_gives_the_same_first_token_every_time(tokenizer):
    from ragblend.models.loading import embedded_gguf_path

    ids = tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]
    peer = llamacpp.LlamaCppPeer(embedded_gguf_path(), 128, llamacpp.PeerSetting(512, False))
    try:
        firsts = {peer.ttft_ms(ids)[1] for _ in range(3)}
    finally:
        peer.close()
    assert len(firsts) == 1
