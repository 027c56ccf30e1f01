"""Layer-wise access to HF decoder-only models, one small adapter per family.

The fusor runs a model one decoder layer at a time on a subset of rows. Each adapter exposes
the pieces of an HF decoder layer (projections, RoPE, attention scaling, MLP) using the model's
own modules and functions, so weights, norms and rotary scaling are exactly HF's.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from ragblend.errors import UnsupportedModelError
from ragblend.models.joined import JoinedLinear, join_linears
from ragblend.models.packed import qkv_projections

if TYPE_CHECKING:
    from ragblend.kernels import LayerKernels, NativeKernels, NormKernel, RopeKernel

# The RMSNorm classes whose forward is LlamaRMSNorm's (what ragblend's native norm computes).
LLAMA_RMS_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})
# The MLP classes whose forward is LlamaMLP's (what the fused SiLU product computes with).
LLAMA_MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})
SILU_ACTIVATIONS = frozenset({"SiLU", "SiLUActivation"})  # torch's and HF's: F.silu


@dataclass
class LayerProjections:
    """Q after RoPE, K before and after RoPE, V; shapes [1, heads, rows, head_dim]."""

    q: torch.Tensor
    k_pre: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


class LayerwiseModel:
    """Llama-family adapter (Llama 2/3, SmolLM2); the other families override small parts."""

    family = "llama"

    def __init__(self, model: torch.nn.Module) -> None:
        # HF's module tree and config are dynamic (``Module.__getattr__`` types every child as
        # ``Tensor | Module``): typed ``Any`` here, once, and the public sizes as ``int``.
        self.model: Any = cast(Any, model)
        self.config: Any = self.model.config
        self.decoder: Any = self.model.model
        self.layers: list[Any] = list(self.decoder.layers)
        attn = self.layers[0].self_attn
        modeling = sys.modules[type(attn).__module__]
        self._apply_rotary = modeling.apply_rotary_pos_emb
        self._rotate_half = getattr(modeling, "rotate_half", None)
        self.num_layers: int = len(self.layers)
        self.head_dim: int = attn.head_dim
        self.num_heads: int = self.config.num_attention_heads
        self.num_kv_heads: int = self.config.num_key_value_heads
        self.hidden_size: int = self.config.hidden_size
        self._joined: dict[tuple[int, str], JoinedLinear | None] = {}
        self.llama_rms_norms: bool = all(
            type(norm).__name__ in LLAMA_RMS_NORMS
            for block in self.layers
            for norm in (block.input_layernorm, block.post_attention_layernorm)
        )

    @property
    def device(self) -> torch.device:
        return self.decoder.norm.weight.device  # the embedding may be quantized blocks

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.norm.weight.dtype

    @property
    def context_window(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 0) or 0)

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        elem = torch.finfo(dtype or self.dtype).bits // 8
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids → hidden states [1, T, D]."""
        return self.decoder.embed_tokens(ids.view(1, -1))

    def rope(
        self, positions: torch.Tensor, like: torch.Tensor, layer: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of ``layer``'s rotary embedding (the model's own) at ``positions`` ([T]
        int64), each [1, T, d]."""
        return self.decoder.rotary_emb(like, positions.view(1, -1))

    def rope_group(self, layer: int) -> str:
        """Layers of one group share a rotary embedding (``rope`` gives them the same cos/sin)."""
        return "all"

    @property
    def rope_rotates_half(self) -> bool:
        """True when the family's RoPE is the rotate_half layout (HF's ``rotate_half``), which
        ragblend's native RoPE kernel implements."""
        return self._rotate_half is not None

    def native_rope(self, kernels: NativeKernels | None, cos: torch.Tensor) -> RopeKernel | None:
        """``kernels``' in-place RoPE where it computes this model's — the rotate_half layout
        over the whole head dim (``cos`` [..., d]), in the kernels' dtype — else None."""
        if kernels is None or not self.rope_rotates_half:
            return None
        if cos.shape[-1] != self.head_dim or cos.dtype != kernels.dtype:
            return None
        return kernels.rope_

    def native_norm(self, kernels: NativeKernels | None) -> NormKernel | None:
        """``kernels``' RMSNorm where this model's layer norms are Llama's, else None."""
        return kernels.rms_norm if kernels is not None and self.llama_rms_norms else None

    def rotate(self, k_pre: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Apply RoPE to pre-RoPE keys [1, H, T, d] (returns a new tensor)."""
        if self._rotate_half is None:
            return self._apply_rotary(k_pre, k_pre, cos, sin)[1]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return torch.addcmul(k_pre * cos, self._rotate_half(k_pre), sin)

    def rotate_(self, k_pre: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE applied in place to pre-RoPE keys [1, H, T, d] (the same values as ``rotate``).

        Saves the two T-row temporaries of ``rotate`` (``k * cos`` and ``rotate_half(k)``) for
        callers that own ``k_pre`` (the fusor's per-request layer tensors); returns ``k_pre``.
        """
        if self._rotate_half is None:  # a family with its own RoPE layout: HF's function
            return k_pre.copy_(self.rotate(k_pre, cos, sin))
        half = k_pre.shape[-1] // 2
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        first = k_pre[..., :half].clone()
        k_pre[..., :half].mul_(cos[..., :half]).addcmul_(
            k_pre[..., half:], sin[..., :half], value=-1
        )
        k_pre[..., half:].mul_(cos[..., half:]).addcmul_(first, sin[..., half:])
        return k_pre

    def sliding_window(self, layer: int) -> int | None:
        return None

    def scaling(self, layer: int) -> float:
        return float(self.layers[layer].self_attn.scaling)

    def joined(self, layer: int, group: str) -> JoinedLinear | None:
        """``layer``'s q/k/v (``group="qkv"``) or gate/up (``"gate_up"``) projections as one
        matmul (:mod:`ragblend.models.joined`), joined on first use; None where they cannot
        be (quantized linears, another MLP)."""
        key = (layer, group)
        joined = self._joined.get(key)
        if joined is not None and joined.is_current():
            return joined
        if joined is None and key in self._joined:
            return None
        block = self.layers[layer]
        modules: tuple[Any, ...] = ()
        if group == "qkv":
            attn = block.self_attn
            modules = (attn.q_proj, attn.k_proj, attn.v_proj)
        elif _silu_mlp(block.mlp):
            modules = (block.mlp.gate_proj, block.mlp.up_proj)
        joined = self._joined[key] = join_linears(modules)
        return joined

    def _qkv(
        self, attn: Any, x: torch.Tensor, joined: JoinedLinear | None = None
    ) -> tuple[torch.Tensor, ...]:
        shape = (*x.shape[:-1], -1, self.head_dim)
        q, k, v = joined(x) if joined is not None else qkv_projections(attn, x)
        return (
            q.view(shape).transpose(1, 2),
            k.view(shape).transpose(1, 2),
            v.view(shape).transpose(1, 2),
        )

    def project(
        self,
        layer: int,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rope_: RopeKernel | None = None,
        norm: NormKernel | None = None,
        kernels: LayerKernels | None = None,
    ) -> LayerProjections:
        """input_layernorm + Q/K/V projections (+ family norms) + RoPE for the given rows.

        ``rope_``: an in-place RoPE with HF's values for this family (ragblend's native one,
        see ``LayerwiseModel.rotate_``) to use instead of ``apply_rotary_pos_emb``; ``norm``:
        the same for the layer norms (for ``llama_rms_norms`` models). ``kernels``: the fused
        device steps (:mod:`ragblend.kernels.cuda.layer_ops`) for the norm and the RoPE of q
        and k where this family's are Llama's, with q/k/v in one matmul (:meth:`joined`)."""
        block = self.layers[layer]
        x = self._norm(block.input_layernorm, hidden, norm, kernels)
        joined = self.joined(layer, "qkv") if kernels is not None else None
        q, k_pre, v = self._qkv(block.self_attn, x, joined)
        if kernels is not None and self.rope_rotates_half:
            q, k = kernels.rope_qk(q, k_pre, cos, sin)
        elif rope_ is None:
            q, k = self._apply_rotary(q, k_pre, cos, sin)
        else:  # q is this call's own; k_pre is kept for the selectors and the store
            q, k = rope_(q, cos, sin), rope_(k_pre.clone(), cos, sin)
        return LayerProjections(q=q, k_pre=k_pre, k=k, v=v)

    def finish(
        self,
        layer: int,
        hidden: torch.Tensor,
        attn_out: torch.Tensor,
        norm: NormKernel | None = None,
        kernels: LayerKernels | None = None,
    ) -> torch.Tensor:
        """o_proj + residual + post-attention norm + MLP + residual; attn_out [1, T, H*d].
        ``norm``, ``kernels``: see ``project`` (``kernels`` also join the residual add with
        the norm, and SiLU with the up projection's product)."""
        block = self.layers[layer]
        delta = block.self_attn.o_proj(attn_out)
        post = block.post_attention_layernorm
        if kernels is not None and self.llama_rms_norms:
            hidden, x = kernels.add_rms_norm(hidden, delta, post.weight, post.variance_epsilon)
        else:
            hidden = hidden + delta
            x = self._norm(post, hidden, norm, kernels)
        mlp = block.mlp
        if kernels is None or not _silu_mlp(mlp):
            return hidden + mlp(x)
        joined = self.joined(layer, "gate_up")
        gate, up = joined(x) if joined is not None else (mlp.gate_proj(x), mlp.up_proj(x))
        return hidden + mlp.down_proj(kernels.silu_mul(gate, up))

    def _norm(
        self,
        module: Any,
        hidden: torch.Tensor,
        norm: NormKernel | None,
        kernels: LayerKernels | None,
    ) -> torch.Tensor:
        if kernels is not None and self.llama_rms_norms:
            return kernels.rms_norm(hidden, module.weight, module.variance_epsilon)
        return _normed(module, hidden, norm)

    def logits(self, hidden_last: torch.Tensor) -> torch.Tensor:
        """Final norm + lm_head on hidden states [1, T, D] → fp32 logits [T, V]."""
        return self.model.lm_head(self.decoder.norm(hidden_last))[0].float()


class MistralLayerwise(LayerwiseModel):
    family = "mistral"

    def sliding_window(self, layer: int) -> int | None:
        return getattr(self.config, "sliding_window", None)


class Qwen2Layerwise(LayerwiseModel):
    family = "qwen2"

    def sliding_window(self, layer: int) -> int | None:
        return getattr(self.layers[layer].self_attn, "sliding_window", None)


class Qwen3Layerwise(Qwen2Layerwise):
    family = "qwen3"

    def _qkv(
        self, attn: Any, x: torch.Tensor, joined: JoinedLinear | None = None
    ) -> tuple[torch.Tensor, ...]:
        shape = (*x.shape[:-1], -1, self.head_dim)
        q, k, v = joined(x) if joined is not None else qkv_projections(attn, x)
        return (
            attn.q_norm(q.view(shape)).transpose(1, 2),
            attn.k_norm(k.view(shape)).transpose(1, 2),
            v.view(shape).transpose(1, 2),
        )


class Gemma3Layerwise(Qwen3Layerwise):
    """Gemma 3 (text): sliding-window layers with a global one every few, a RoPE base per
    layer type, q/k norms, norms after attention and after the MLP too, scaled embeddings
    (HF's embedding module scales them) and an optional final logit softcap."""

    family = "gemma3"

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        for unsupported in ("attn_logit_softcapping", "use_bidirectional_attention"):
            if getattr(self.config, unsupported, None):
                raise UnsupportedModelError(f"Gemma 3 with {unsupported} is not supported")

    def rope(
        self, positions: torch.Tensor, like: torch.Tensor, layer: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.decoder.rotary_emb(like, positions.view(1, -1), self.rope_group(layer))

    def rope_group(self, layer: int) -> str:
        return str(self.config.layer_types[layer])

    def sliding_window(self, layer: int) -> int | None:
        return self.layers[layer].self_attn.sliding_window

    def finish(
        self,
        layer: int,
        hidden: torch.Tensor,
        attn_out: torch.Tensor,
        norm: NormKernel | None = None,
        kernels: LayerKernels | None = None,
    ) -> torch.Tensor:
        # Gemma's norms are (1 + weight) and its MLP GELU: HF's modules under any kernels
        block = self.layers[layer]
        hidden = hidden + block.post_attention_layernorm(block.self_attn.o_proj(attn_out))
        mlp_out = block.mlp(block.pre_feedforward_layernorm(hidden))
        return hidden + block.post_feedforward_layernorm(mlp_out)

    def logits(self, hidden_last: torch.Tensor) -> torch.Tensor:
        logits = self.model.lm_head(self.decoder.norm(hidden_last))[0]
        cap = self.config.final_logit_softcapping
        if cap is not None:  # in the model's dtype, as HF's forward does it
            logits = torch.tanh(logits / cap) * cap
        return logits.float()


def _silu_mlp(mlp: Any) -> bool:
    """Whether ``mlp`` is HF's ``LlamaMLP`` shape with SiLU (``down(silu(gate(x)) * up(x))``)."""
    return (
        type(mlp).__name__ in LLAMA_MLPS
        and type(getattr(mlp, "act_fn", None)).__name__ in SILU_ACTIVATIONS
        and all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj"))
    )


def _normed(module: Any, hidden: torch.Tensor, norm: NormKernel | None) -> torch.Tensor:
    if norm is None:
        return module(hidden)
    return norm(hidden.contiguous(), module.weight, module.variance_epsilon)


ADAPTERS: dict[str, type[LayerwiseModel]] = {
    "LlamaForCausalLM": LayerwiseModel,
    "MistralForCausalLM": MistralLayerwise,
    "Qwen2ForCausalLM": Qwen2Layerwise,
    "Qwen3ForCausalLM": Qwen3Layerwise,
    "Gemma3ForCausalLM": Gemma3Layerwise,
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(ADAPTERS)


def check_supported(architecture: str) -> type[LayerwiseModel]:
    try:
        return ADAPTERS[architecture]
    except KeyError:
        raise UnsupportedModelError(
            f"unsupported model architecture {architecture!r}; ragblend supports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        ) from None


def adapter_for(model: torch.nn.Module) -> LayerwiseModel:
    """The layer-wise adapter for an HF causal LM (raises UnsupportedModelError otherwise)."""
    return check_supported(type(model).__name__)(model)
