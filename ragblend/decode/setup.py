"""How one engine decodes after its prefills: its options resolved, its decoders made.

:class:`DecodeSetup` holds what ``BlendEngine``'s decode methods share: the decode-step linears
packed, ``BlendConfig.decode_activations`` resolved, the static decode pools (shared by an
engine's views), and the decoders, greedy answers and teacher-forced logits after a prefill.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Collection
from typing import TYPE_CHECKING

import torch

from ragblend.decode.generation import (
    Decoder,
    HFDecoder,
    Prefill,
    decode_tokens,
    decoder_for,
    teacher_forced_logits,
)
from ragblend.decode.pool import DecodePool
from ragblend.decode.sampling import SamplingParams
from ragblend.models.packed import is_packed, pack_decode_linears
from ragblend.models.quantized import decode_activations_for, decode_path

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ragblend.config import BlendConfig
    from ragblend.decode.decoder import LayerDecoder
    from ragblend.kernels.choice import KernelChoice
    from ragblend.models.adapters import LayerwiseModel


class DecodeSetup:
    """One engine view's decoding: ``config``'s decode options on ``kernels``' choice.

    ``pools``: the static decode pools by (slots, tokens, CUDA graphs), shared with the
    views :meth:`for_view` makes.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        layers: LayerwiseModel,
        config: BlendConfig,
        kernels: KernelChoice,
        pools: dict[tuple[int, int, bool], DecodePool] | None = None,
    ) -> None:
        self.model, self.layers, self.config, self.kernels = model, layers, config, kernels
        self.pools = {} if pools is None else pools
        self._activations: str | None = None  # resolved on first use

    def for_view(self, config: BlendConfig, kernels: KernelChoice) -> DecodeSetup:
        """The setup of a view with ``config`` and ``kernels`` (same model and pools)."""
        view = DecodeSetup(self.model, self.layers, config, kernels, self.pools)
        if config.decode_activations == self.config.decode_activations:
            view._activations = self._activations
        return view

    def prepare(self) -> None:
        """Decode-step linears on prepacked weights where the copy fits
        (``config.packed_decode``; once per model), and :attr:`activations` resolved."""
        if self.config.packed_decode:
            pack_decode_linears(self.model)
        self.activations  # noqa: B018 (resolved now: the int8 kernels built, or not)

    @property
    def activations(self) -> str:
        """``"int8"`` or ``"float"``: ``config.decode_activations`` resolved for this CPU."""
        if self._activations is None:
            self._activations = decode_activations_for(self.model, self.config.decode_activations)
        return self._activations

    @property
    def pool(self) -> DecodePool | None:
        """The static decode K/V pool (``config.decode_slots``), made on first use; None where
        it is off."""
        slots = self.config.decode_slots
        if slots is None:
            slots = 8 if self.layers.device.type != "cpu" else 0
        if not slots:
            return None
        tokens = self.config.decode_pool_tokens
        if self.layers.context_window:
            tokens = min(tokens, self.layers.context_window)
        key = (slots, tokens, self.config.cuda_graphs)
        pool = self.pools.get(key)
        if pool is None:
            graphs = self.config.cuda_graphs
            pool = self.pools[key] = DecodePool(self.layers, slots, tokens, cuda_graphs=graphs)
        return pool

    @property
    def path(self) -> str:
        """What a decode step's linears read (``BlendEngine.decode_path``)."""
        quantized = decode_path(self.model)
        if quantized is not None and self.activations == "int8":
            return quantized.replace("-native", "-int8")
        if quantized is not None:
            return quantized
        name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
        dtype = name.get(self.layers.dtype, str(self.layers.dtype))
        return f"{dtype}-packed" if is_packed(self.model) else dtype

    def decoder(self, prefill: Prefill, max_new_tokens: int) -> LayerDecoder | HFDecoder:
        """A decoder after ``prefill`` with room for ``max_new_tokens``, taking a slot of
        :attr:`pool` and the fused layer steps where there are."""
        total = len(prefill.prompt_ids) + max_new_tokens
        kv, activations = self.config.kv_cache_dtype, self.activations
        native = self.kernels.native
        return decoder_for(
            self.model,
            self.layers,
            prefill,
            total,
            native,
            kv,
            activations,
            self.pool,
            self.kernels.layer_kernels,
        )

    def streamer(
        self, tokenizer, eos_ids: Collection[int], params: SamplingParams, max_new_tokens: int
    ) -> Decoder:
        """What turns a prefill into a text stream (:class:`Decoder`)."""
        return Decoder(
            self.model,
            tokenizer,
            eos_ids,
            params,
            max_new_tokens,
            self.layers,
            self.kernels.native,
            self.config.kv_cache_dtype,
            self.activations,
        )

    def greedy_answer(
        self, prefill: Prefill, max_new_tokens: int, eos_ids: Collection[int]
    ) -> list[int]:
        """Greedy answer ids after ``prefill`` (EOS excluded; ``prefill`` left as it was)."""
        pre = dataclasses.replace(prefill, stats=copy.copy(prefill.stats))
        self.prepare()
        ids = decode_tokens(
            self.model,
            pre,
            SamplingParams(),
            max_new_tokens,
            eos_ids,
            self.layers,
            self.kernels.native,
            kv_cache_dtype=self.config.kv_cache_dtype,
            activations=self.activations,
        )
        return list(ids)

    def teacher_forced_logits(self, prefill: Prefill, answer_ids: list[int]) -> torch.Tensor:
        """fp32 logits [len(answer_ids), V] predicting each answer token after the prompt,
        through this setup's decode steps."""
        self.prepare()
        return teacher_forced_logits(
            self.model,
            prefill,
            answer_ids,
            self.layers,
            self.kernels.native,
            kv_cache_dtype=self.config.kv_cache_dtype,
            activations=self.activations,
        )
