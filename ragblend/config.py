"""BlendConfig: every knob of the fusion path in one place."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from ragblend.errors import RagblendError
from ragblend.kernels import (
    LayerKernelsChoice,
    RowAttention,
    check_layer_kernels,
    check_row_attention,
)
from ragblend.models.gguf import Weights, check_weights

Mode = Literal["full", "prefix", "reuse", "blend"]
MODES: tuple[str, ...] = ("full", "prefix", "reuse", "blend")
# storage dtypes and codecs of chunk KV; ``pca<bits>`` names the transform coder at any budget
# of 0 < bits <= 8 a value (these are the ones measured: docs/stores.md)
KV_DTYPES: tuple[str, ...] = (
    "auto",
    "float32",
    "bfloat16",
    "float16",
    "int8",
    "k8v4",
    "k4v8",
    "int4",
    "int2",
    "pca4",
    "pca2",
    "pca1",
)
DecodeActivations = Literal["auto", "float", "int8"]
DECODE_ACTIVATIONS: tuple[str, ...] = get_args(DecodeActivations)
KvCacheDtype = Literal["auto", "int8"]
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KvCacheDtype)
PrecomputeContext = Literal[
    "prefix", "canonical", "filler", "bos", "none", "neighbours", "previous"
]
PRECOMPUTE_CONTEXTS: tuple[str, ...] = get_args(PrecomputeContext)
# Contexts that put other chunks of the corpus before a chunk (``ragblend.neighbours``).
NEIGHBOUR_CONTEXTS: tuple[str, ...] = ("neighbours", "previous")
NeighbourRows = Literal["reused", "computed"]
NEIGHBOUR_ROWS: tuple[str, ...] = get_args(NeighbourRows)


@dataclass(frozen=True)
class SelectionPolicy:
    """The selection levers measured against :class:`BlendConfig`'s defaults that did not win:
    each is off, or at the value the measurements kept (docs/configuration.md, "Selection
    policy"). For experiments: ``BlendConfig(selection=SelectionPolicy(cached_temperature=1.06))``.

    deviation: which cached tensor KV deviation is measured on: ``"k"``, ``"v"`` or ``"kv"``
        (``"v"`` tied with ``"kv"``, ``"k"`` lost: ``sweep1``, ``sweep_final``).
    cached_temperature: attention logits to rows still served from the cache (not recomputed
        on that layer) are divided by this temperature during a blend prefill (APE); the KV
        kept for decoding is unchanged, and full KV reuse (``mode="reuse"``) is not tempered.
        1.0: off (1.06 helped isolated caches and hurt neighbour-aware ones).
    fitted_chunk_weight: a chunk whose cache was precomputed after the chunk that precedes it
        in the prompt (one of its precompute neighbours, recorded in the entry) is nearly
        what full prefill computes: its rows' selector scores are multiplied by this weight,
        and below 1 its chunk starts are not always kept (0: its rows are recomputed only
        after every other row). 1.0: off (0.5, 0.25 and 0 tied with it on held-out questions).
        Needs a neighbour context.
    adaptive_mass: instead of a fixed ratio, a check layer keeps the fewest top-scored rows
        covering this share of the selector's score mass, clamped to ``adaptive_ratio``
        (min, max) × the check layer's scale. ``None``: off (faster, worse fidelity).
    """

    deviation: Literal["k", "v", "kv"] = "kv"
    cached_temperature: float = 1.0
    fitted_chunk_weight: float = 1.0
    adaptive_mass: float | None = None
    adaptive_ratio: tuple[float, float] = (0.05, 0.3)

    def __post_init__(self) -> None:
        if self.deviation not in ("k", "v", "kv"):
            raise RagblendError(f"deviation must be 'k', 'v' or 'kv', got {self.deviation!r}")
        t = self.cached_temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise RagblendError(f"cached_temperature must be a number > 0, got {t!r}")
        w = self.fitted_chunk_weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w <= 1:
            raise RagblendError(f"fitted_chunk_weight must be a number in [0, 1], got {w!r}")
        mass = self.adaptive_mass
        if mass is not None and (
            isinstance(mass, bool) or not isinstance(mass, (int, float)) or not 0 < mass <= 1
        ):
            raise RagblendError(f"adaptive_mass must be None or a number in (0, 1], got {mass!r}")
        bounds = self.adaptive_ratio
        if (
            not isinstance(bounds, (tuple, list))
            or len(bounds) != 2
            or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in bounds)
            or not 0 <= bounds[0] <= bounds[1] <= 1
        ):
            raise RagblendError(
                f"adaptive_ratio must be (min, max) with 0 <= min <= max <= 1, got {bounds!r}"
            )
        # a list is accepted as before; a tuple keeps the policy hashable
        object.__setattr__(self, "adaptive_ratio", tuple(bounds))


# BlendConfig's former fields that live in its ``selection`` now: deprecated aliases
MOVED_TO_SELECTION: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SelectionPolicy))


@dataclass
class BlendConfig:
    """Settings of the CacheBlend fusion path.

    ratio: the recompute ratio r (default 0.15): about this fraction of the cached chunk
        tokens is recomputed on each layer after the first check layer (``check_scales`` shapes
        it per check layer); ``"auto"`` lets the loading controller choose it.
    check_layers: layers at which tokens are (re)selected by the selector. Every layer up to and
        including the first check layer runs on all tokens.
    check_scales: gradual filtering (paper §4.3) as multiples of ``ratio``, one per check
        layer: check layer i keeps ``ratio * check_scales[i]`` of the cached tokens, choosing
        within the previous selection. ``None`` means 1.0 at every check layer; the rows kept
        at the last check layer are recomputed on all later layers.
    selector: name of a registered token selector (``kv-deviation``).
    chunk_start_tokens: the first k tokens of every cached chunk are always recomputed (kept at
        every check layer, within the budget when it allows; EPIC's per-chunk attention sinks).
        0: off. Combines with any selector.
    near_question_tokens: the last k cached tokens before the question are recomputed first
        after the chunk starts (kept at every check layer, closest to the question first,
        always inside the budget): the rows the question reads most closely. 0: off.
        Combines with any selector.
    selection: the selection levers that were measured against these defaults and did not
        win (:class:`SelectionPolicy`), for experiments. Their old names (``deviation``,
        ``cached_temperature``, ``fitted_chunk_weight``, ``adaptive_mass``,
        ``adaptive_ratio``) still work as keyword arguments and attributes, with a
        ``DeprecationWarning``.
    weights: ``"auto"`` (default) keeps a GGUF's quantized tensors (Q4_0, Q4_1, Q5_0, Q5_1,
        Q8_0, Q4_K, Q5_K, Q6_K) as stored on CPU: decode steps read the blocks through native
        kernels, prefills dequantize them (``ragblend.models.quantized``), once and kept where
        all of a model's linears fit in 1 GiB in the compute dtype (the embedded model), else
        in every prefill; ``"dequantize"`` converts every weight to the compute dtype at load.
        HF directories load as they are.
    namespace: tenant salt mixed into every chunk and prefix key (``None``: no tenant). Set by
        the server side that builds the engine; tenants never hit each other's entries.
    kv_dtype: storage dtype or codec of chunk KV, independent of the compute dtype: ``"auto"``
        (``int8`` on a float32 model, else the compute dtype: chosen on the fidelity–bytes
        frontier, ``ragblend.store.quant.AUTO_KV_DTYPES``), ``"float32"``, ``"bfloat16"``,
        ``"float16"``, ``"int8"`` (8-bit, a scale per channel or token), ``"k8v4"``/``"k4v8"``/
        ``"int4"``/``"int2"`` (group-wise codes, a scale per 64 values,
        ``ragblend.store.groupwise``) or ``"pca<bits>"`` such as ``"pca2"`` (a transform coder
        at ``bits`` a value over a basis calibrated once per model and kept in the store,
        ``ragblend.store.transform``). Part of every key, so an entry never serves a request
        expecting another. Bytes and fidelity: docs/stores.md.
    precompute_context: what each chunk is prefilled after when its KV is precomputed:
        ``"prefix"`` (the prompt head: template + system prompt), ``"canonical"`` (the chat
        template's head with a fixed neutral system prompt: hits under any template),
        ``"filler"``, ``"bos"`` or ``"none"``; ``"neighbours"`` (the canonical head, then the
        chunk's ``precompute_neighbours`` most similar chunks known to the engine's neighbour
        source, most similar last, each followed by the canonical separator; their rows are
        dropped) or ``"previous"`` (the same with the chunk before it in its document). Their
        key is ``"canonical"``'s (the chunk's content): lookups, the matcher and the server are
        unchanged, and a chunk already stored is not recomputed.
    precompute_neighbours: how many neighbours ``"neighbours"`` puts before a chunk (>= 1).
    neighbour_rows: how a neighbour context's neighbours are given to the chunk:
        ``"reused"`` (their KV from the store, RoPE-shifted into place like any cached chunk:
        their own cache where stored, else their isolated KV, computed once and kept in the
        precomputing process's memory; only the chunk's rows are computed) or ``"computed"`` (every
        neighbour row computed with the chunk, exactly as a prefill of the whole context).
    exact_first_chunk: precompute also stores each chunk as a prompt's *first* chunk sees it:
        prefilled after the prompt head exactly as full prefill computes it (a prefix cache of
        head + chunk; one more entry per chunk and prompt head, at ``kv_dtype``). A prompt
        whose first chunk has that entry takes it, and where ``kv_dtype`` is the compute dtype
        its rows are exact: never recomputed, out of the ratio's budget. ``False``: one entry
        per chunk (half the storage, a faster precompute). With ``precompute_context="prefix"``
        the chunk's own entry is that one already.
    packed_decode: on CPU, decode steps' linears run on oneDNN weights prepacked once
        (``ragblend.models.packed``): bf16 one-row inputs (identical outputs; CPUs at the
        ``avx512`` level or with AVX-NE-CONVERT) and fp32 inputs of up to 16 rows (a batched
        step; fp32 rounding, each row the same in any batch). Faster decoding, a second copy of
        the linear weights from the first decode on, made only where it fits in half the
        available memory (an engine that only precomputes never makes it). ``False``: one copy.
    row_attention: how blend's selected rows attend: ``"auto"`` (ragblend's native kernels
        where they run — fp32 on CPUs with AVX2 + FMA, bf16 on CPUs with AVX512-BF16 or AMX,
        compiled on first use — else SDPA in masked blocks; a capable CPU that cannot build
        them logs a warning; on a GPU ``"masked"``), ``"native"`` (an error where they cannot
        run), ``"sdpa"`` (position-ordered blocks, their bounds read on the host) or
        ``"masked"`` (one SDPA call per layer over every key, its mask built on the device from
        the rows' positions: no host sync). Same attention every way, to rounding; the native
        path also runs RoPE and Llama-family RMSNorms in one pass each (HF's values bit for
        bit), and decode steps' attention for all running requests in one call (over fp32 or
        bf16 K/V). See
        ``ragblend.kernels.cpu.native``.
    layer_kernels: the kernels of a fused prefill's layer steps where ragblend's native CPU
        kernels do not run (a GPU, or ``row_attention="masked"``/``"sdpa"``): ``"hf"`` (HF's
        modules: six kernels per RMSNorm, five per RoPE), ``"fused"`` (one registered op per
        norm, residual add + norm, RoPE of q and k, in-place RoPE of the cached keys, K/V
        scatter and SiLU product, ``ragblend.kernels.cuda.layer_ops``: Triton kernels on CUDA,
        checked against torch references of HF's arithmetic when they load; those references
        elsewhere) or ``"auto"`` (``"hf"`` until a GPU run of ``benchmarks/gpu_check.sh`` has
        checked the Triton kernels).
    decode_activations: how a decode step multiplies its rows by a GGUF's kept-quantized
        weights: ``"float"`` (the rows as they are: dequantize + ``F.linear`` to fp32
        rounding), ``"int8"`` (llama.cpp's arithmetic: each row quantized to 8 bits per block
        of the weight's type, Q8_0 per 32 values or Q8_K per 256, and integer dot products;
        ``ragblend.kernels.cpu.int8_decode``) or ``"auto"`` (what was measured faster at this CPU
        level: ``ragblend.kernels.cpu.int8_decode.AUTO_BY_LEVEL``). Prefills keep the exact path;
        dense models are unaffected.
    decode_slots: requests a static decode K/V pool holds (``ragblend.decode.pool``): their
        decode buffers are slots of one tensor per layer, and a step of requests that share it
        attends in one call per layer. ``None`` (default): 8 on a GPU, 0 (off: a buffer per
        request, the native CPU kernels' layout) on a CPU. A request that finds no free slot,
        or needs more than the pool's tokens (``decode_pool_tokens``), gets its own buffers.
    decode_pool_tokens: the tokens (prompt + answer) a pool slot holds (default 4096).
    cuda_graphs: replay a decode pool's step from a CUDA graph (``ragblend.decode.graph``;
        one launch of host time per step instead of hundreds) on a GPU. Off by default until
        a GPU run of ``benchmarks/gpu_check.sh`` has checked it; a capture that fails falls
        back to eager steps with one warning.
    kv_cache_dtype: the decode-time K/V cache (the prompt's K/V copied for decoding and every
        generated token's): ``"auto"`` (the model's dtype) or ``"int8"`` (8-bit codes with
        scales, half of bf16's bytes for each decode step to read). The chunk KV store and
        prefills are unchanged.
    """

    ratio: float | Literal["auto"] = 0.15
    # Gradual filtering chosen by benchmarks/quality/sweep.py on held-out dev questions: keep 1.5·r
    # after layer 1, then r from layer 10 (0.7·r until issue 54: on neighbour-aware caches the
    # always-kept rows below need the later layers' budget; quality_sweep --which neighbours2).
    check_layers: tuple[int, ...] = (1, 10)
    check_scales: tuple[float, ...] | None = (1.5, 1.0)
    selector: str = "kv-deviation"
    # Chosen on neighbour-aware caches (issue 54, docs/neighbour_caches.md): the chunk starts
    # and the rows nearest the question carry most of the KL that recompute can remove.
    chunk_start_tokens: int = 16
    near_question_tokens: int = 256
    selection: SelectionPolicy = field(default_factory=SelectionPolicy, kw_only=True)
    # Template-independent: a chunk warmed once hits under any template or system prompt, at
    # +2.8 % blend answer KL vs the exact head (benchmarks/results/intel-amx/context_choice.json).
    # Neighbours where the engine has a neighbour source (else exactly canonical, same key): on
    # held-out dev questions 20-39 (fp32, r = 0.15) blend's answer KL 0.34x isolated reuse's
    # against 0.76x with isolated caches, better on 19 of 20 questions, for 0.29x the warmup
    # throughput (benchmarks/quality/neighbour_contexts.py).
    precompute_context: PrecomputeContext = "neighbours"
    precompute_neighbours: int = 2
    # Reused: blend answer KL 0.37x isolated reuse's instead of 0.34x (questions 20-39) for
    # 1.34x an isolated precompute per chunk once its neighbours are stored instead of 3.59x
    # (benchmarks/quality/neighbour_contexts.py --neighbour-rows,
    # benchmarks/store/neighbour_cost.py).
    neighbour_rows: NeighbourRows = "reused"
    # The first chunk's neighbour cache saw neighbours its prompt does not have; its exact
    # entry (one more per chunk) took blend's answer KL from 0.57x to 0.46x reuse's on held-out
    # dev questions 12-39 (0.51x to 0.36x on 0-11), first-token KL 0.54x to 0.42x, and with
    # its rows out of the budget the same ratio ran faster (benchmarks/quality_sweep.py
    # --which first_chunk).
    exact_first_chunk: bool = True
    mode: Mode = "blend"
    device: str = "cpu"
    dtype: str = "auto"
    weights: Weights = "auto"
    namespace: str | None = None
    kv_dtype: str = "auto"
    max_new_tokens: int = 64
    packed_decode: bool = True
    row_attention: RowAttention = "auto"
    layer_kernels: LayerKernelsChoice = "auto"
    decode_activations: DecodeActivations = "auto"
    kv_cache_dtype: KvCacheDtype = "auto"
    decode_slots: int | None = None
    decode_pool_tokens: int = 4096
    cuda_graphs: bool = False
    ram_bytes: int = 4 << 30
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_mode(self.mode)
        check_ratio(self.ratio)
        if not self.check_layers:
            raise RagblendError("check_layers must name at least one layer")
        if list(self.check_layers) != sorted(set(self.check_layers)) or self.check_layers[0] < 0:
            raise RagblendError(
                f"check_layers must be increasing and >= 0, got {self.check_layers}"
            )
        if self.check_scales is not None:
            if len(self.check_scales) != len(self.check_layers):
                raise RagblendError("check_scales needs one multiplier per check layer")
            scales = list(self.check_scales)
            if any(s <= 0 for s in scales) or scales != sorted(scales, reverse=True):
                raise RagblendError(
                    f"check_scales must be positive and non-increasing, got {self.check_scales}"
                )
        check_selection_options(self)
        if not isinstance(self.selection, SelectionPolicy):
            raise RagblendError(
                f"selection must be a SelectionPolicy, got {type(self.selection).__name__}"
            )
        check_kv_dtype(self.kv_dtype)
        if self.namespace is not None and not isinstance(self.namespace, str):
            raise RagblendError(f"namespace must be a string or None, got {self.namespace!r}")
        check_row_attention(self.row_attention)
        check_layer_kernels(self.layer_kernels)
        if self.decode_slots is not None and self.decode_slots < 0:
            raise RagblendError(f"decode_slots must be >= 0 or None, got {self.decode_slots}")
        if self.decode_pool_tokens < 1:
            raise RagblendError(f"decode_pool_tokens must be >= 1, got {self.decode_pool_tokens}")
        if self.decode_activations not in DECODE_ACTIVATIONS:
            raise RagblendError(
                f"unknown decode_activations {self.decode_activations!r}; expected one of "
                f"{', '.join(DECODE_ACTIVATIONS)}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise RagblendError(
                f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; expected one of "
                f"{', '.join(KV_CACHE_DTYPES)}"
            )
        check_weights(self.weights)
        if self.precompute_context not in PRECOMPUTE_CONTEXTS:
            raise RagblendError(
                f"unknown precompute_context {self.precompute_context!r}; expected one of "
                f"{', '.join(PRECOMPUTE_CONTEXTS)}"
            )
        if self.neighbour_rows not in NEIGHBOUR_ROWS:
            raise RagblendError(
                f"neighbour_rows must be one of {', '.join(NEIGHBOUR_ROWS)}, "
                f"got {self.neighbour_rows!r}"
            )
        if not isinstance(self.exact_first_chunk, bool):
            raise RagblendError(
                f"exact_first_chunk must be True or False, got {self.exact_first_chunk!r}"
            )
        n = self.precompute_neighbours
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise RagblendError(f"precompute_neighbours must be an integer >= 1, got {n!r}")

    def schedule(self, ratio: float) -> list[tuple[int, float]]:
        """(check layer, fraction of cached tokens kept) pairs for a final ``ratio``."""
        scales = self.check_scales or (1.0,) * len(self.check_layers)
        return [(layer, min(1.0, ratio * s)) for layer, s in zip(self.check_layers, scales)]


def _warn_moved(name: str) -> None:
    warnings.warn(
        f"BlendConfig.{name} is deprecated: it moved to BlendConfig.selection "
        f"(BlendConfig(selection=SelectionPolicy({name}=...)), config.selection.{name})",
        DeprecationWarning,
        stacklevel=3,
    )


def _accepting_moved_names(init: Any) -> Any:
    """The dataclass ``__init__`` taking the moved names too: each warns and lands in the
    ``selection`` given (else the default one), so ``dataclasses.replace(config,
    cached_temperature=1.06)`` keeps the rest of ``config.selection``."""

    @functools.wraps(init)
    def __init__(self: BlendConfig, *args: Any, **kwargs: Any) -> None:
        moved = {name: kwargs.pop(name) for name in MOVED_TO_SELECTION if name in kwargs}
        if moved:
            for name in moved:
                _warn_moved(name)
            selection = kwargs.get("selection", SelectionPolicy())
            if isinstance(selection, SelectionPolicy):  # else __post_init__ says why
                kwargs["selection"] = dataclasses.replace(selection, **moved)
        init(self, *args, **kwargs)

    return __init__


def _moved_attribute(name: str) -> property:
    def get(config: BlendConfig) -> Any:
        _warn_moved(name)
        return getattr(config.selection, name)

    def set_(config: BlendConfig, value: Any) -> None:
        _warn_moved(name)
        config.selection = dataclasses.replace(config.selection, **{name: value})

    return property(get, set_, doc=f"Deprecated: ``selection.{name}``.")


BlendConfig.__init__ = _accepting_moved_names(BlendConfig.__init__)  # type: ignore[method-assign]
for _name in MOVED_TO_SELECTION:
    setattr(BlendConfig, _name, _moved_attribute(_name))
del _name


def fold_selection(config: BlendConfig, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``overrides`` of BlendConfig fields, where the selection levers among them (named as
    :class:`SelectionPolicy`'s fields, as experiments name them) are folded into one
    ``selection`` over ``config``'s: what an experiment hands ``engine.with_config(**...)``."""
    moved = {k: v for k, v in overrides.items() if k in MOVED_TO_SELECTION}
    rest = {k: v for k, v in overrides.items() if k not in MOVED_TO_SELECTION}
    if moved:
        rest["selection"] = dataclasses.replace(rest.get("selection", config.selection), **moved)
    return rest


def check_kv_dtype(kv_dtype: object) -> str:
    """``kv_dtype`` if it names a storage dtype or codec of chunk KV (or ``"auto"``), else a
    RagblendError naming them."""
    from ragblend.store.transform import pca_bits

    if kv_dtype in KV_DTYPES or (isinstance(kv_dtype, str) and pca_bits(kv_dtype) is not None):
        return str(kv_dtype)
    raise RagblendError(
        f"unknown kv_dtype {kv_dtype!r}; expected one of {', '.join(KV_DTYPES)} or "
        "pca<bits> (0 < bits <= 8, e.g. pca1.5)"
    )


def kv_dtype_argument(value: str) -> str:
    """``--kv-dtype``'s argparse type: the name, or argparse's usage error naming the choices."""
    import argparse

    try:
        return check_kv_dtype(value)
    except RagblendError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def check_mode(mode: str) -> str:
    """``mode`` if it is one of MODES, else a RagblendError naming them."""
    if mode not in MODES:
        raise RagblendError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    return mode


def check_selection_options(config: BlendConfig) -> None:
    """A RagblendError naming the first invalid selection option of ``config`` (its
    ``selection`` checks itself)."""
    for name in ("chunk_start_tokens", "near_question_tokens"):
        k = getattr(config, name)
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise RagblendError(f"{name} must be an integer >= 0, got {k!r}")


def check_ratio(ratio: object) -> None:
    """A RagblendError unless ``ratio`` is None, "auto" or a number in [0, 1]."""
    if ratio is None or ratio == "auto":
        return
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
        raise RagblendError(f"ratio must be a number in [0, 1] or 'auto', got {ratio!r}")


def fit_to_depth(config: BlendConfig, num_layers: int) -> BlendConfig:
    """``config`` with check layers the model has.

    The default schedule (check layers (1, 10)) is cut to the layers a shallower model has,
    keeping ``ratio`` after its last check layer; check layers set explicitly beyond the
    model's depth are an error.
    """
    depth = num_layers
    if config.check_layers[-1] < depth:
        return config
    defaults = BlendConfig()
    is_default = (config.check_layers, config.check_scales) == (
        defaults.check_layers,
        defaults.check_scales,
    )
    kept = tuple(layer for layer in config.check_layers if layer < depth)
    if is_default and kept:
        return dataclasses.replace(config, check_layers=kept, check_scales=None)
    if config.check_layers[-1] >= depth:
        raise RagblendError(
            f"check_layers {config.check_layers} name a layer the model does not have: it has "
            f"{depth} layers (0..{depth - 1})"
        )
    return config
