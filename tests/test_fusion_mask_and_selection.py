"""The exact causal mask by original position, gradual filtering and forced tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import CHUNKS, QUESTION, tiny_model
from helpers import engine_for, fuse_prompt

from ragblend.errors import RagblendError
from ragblend.fusion.attention import RowAttentionPlan, attend_rows, position_mask
from ragblend.fusion.fusor import Segment, fuse
from ragblend.fusion.trace import SelectionTrace
from ragblend.store.base import ChunkKV


def _reference_rows(q, k, v, positions, scaling, window=None):
    """Per-row attention over keys 0..p (and > p - window), the slow obvious way."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    rows = []
    for i, p in enumerate(positions.tolist()):
        lo = 0 if window is None else max(0, p - window + 1)
        scores = (q[0, :, i : i + 1] @ k[0, :, lo : p + 1].transpose(-1, -2)) * scaling
        rows.append(F.softmax(scores, dim=-1) @ v[0, :, lo : p + 1])
    out = torch.cat(rows, dim=1)  # [H, m, d]
    return out.transpose(0, 1).reshape(1, len(positions), -1)


def test_position_mask_uses_original_positions_not_bottom_right_alignment():
    positions = torch.tensor([2, 5, 9])
    mask = position_mask(positions, 12)
    assert mask[0].tolist() == [True] * 3 + [False] * 9
    assert mask[1].sum() == 6 and mask[2].sum() == 10
    bottom_right = torch.ones(3, 12).tril(diagonal=12 - 3).bool()
    assert not torch.equal(mask, bottom_right)


def _scattered_rows(n: int = 700, rows: int = 300, heads: int = 4, kv_heads: int = 2, dim: int = 8):
    """Ascending random positions of ``rows`` of ``n`` tokens, their queries and every key."""
    torch.manual_seed(0)
    positions = torch.tensor(sorted(torch.randperm(n)[:rows].tolist()))
    q = torch.randn(1, heads, positions.numel(), dim)
    k, v = torch.randn(1, kv_heads, n, dim), torch.randn(1, kv_heads, n, dim)
    return positions, q, k, v


def test_blocked_gqa_attention_matches_per_row_reference_with_and_without_window():
    positions, q, k, v = _scattered_rows()
    heads, kv_heads = q.shape[1], k.shape[1]
    for window in (None, 50):
        plan = RowAttentionPlan(positions, heads // kv_heads, q.dtype, window)
        assert len(plan.blocks) > 1
        got = attend_rows(q, k, v, plan, 0.3)
        torch.testing.assert_close(
            got, _reference_rows(q, k, v, positions, 0.3, window), atol=1e-5, rtol=1e-5
        )


class EarlyFirstSelector:
    """Deterministic scores favouring early positions: the selection ignores later rows."""

    name = "early-first"

    def scores(self, check):
        return -check.rows.float()


def test_selected_token_never_attends_to_a_later_key(tokenizer):
    """Perturbing the cached KV of the last chunk leaves earlier selected rows untouched.

    A bottom-right aligned mask lets early selected rows see later keys, so this fails there.
    """
    model = tiny_model("llama")
    engine = engine_for(model, tokenizer, kv_dtype="float32")  # entries perturbed as floats
    engine.precompute(CHUNKS)
    prompt = engine.tokenize(QUESTION, CHUNKS)
    context = engine.chunks.context_ids(prompt.head)

    def segments(noise: float):
        segs = [Segment("prefix", prompt.head, engine.prefix_kv(prompt.head), exact=True)]
        for i, chunk in enumerate(prompt.chunks):
            if i:
                segs.append(Segment("separator", prompt.separator))
            kv = engine.store.get(engine.chunk_key(context_ids=context, chunk_ids=chunk))
            if i == len(prompt.chunks) - 1 and noise:
                g = torch.Generator().manual_seed(1)
                kv = ChunkKV(
                    kv.k + noise * torch.randn(kv.k.shape, generator=g),
                    kv.v + noise * torch.randn(kv.v.shape, generator=g),
                )
            segs.append(Segment("chunk", chunk, kv))
        segs.append(Segment("tail", prompt.tail))
        return segs

    results = []
    for noise in (0.0, 5.0):
        segs = segments(noise)
        results.append(
            fuse(engine.layers, segs, engine.chunks.loader(segs), [(0, 0.3)], EarlyFirstSelector())
        )
    clean, noisy = results
    assert torch.equal(clean.selected, noisy.selected)
    last_chunk_start = len(prompt.ids) - len(prompt.tail) - len(prompt.chunks[-1])
    early = clean.selected[clean.selected < last_chunk_start]
    assert early.numel() > 10
    for layer in range(1, engine.layers.num_layers):
        torch.testing.assert_close(
            clean.keys[layer][:, :, early], noisy.keys[layer][:, :, early], atol=1e-6, rtol=0
        )
        torch.testing.assert_close(
            clean.values[layer][:, :, early], noisy.values[layer][:, :, early], atol=1e-6, rtol=0
        )
    assert not torch.allclose(clean.logits, noisy.logits)


def test_gradual_filtering_selects_within_the_previous_selection(tokenizer):
    model = tiny_model("llama", num_hidden_layers=4)
    engine = engine_for(
        model,
        tokenizer,
        ratio=0.2,
        check_layers=(0, 1, 2),
        check_scales=(3.0, 2.0, 1.0),
        chunk_start_tokens=0,  # the selector's rows alone
        near_question_tokens=0,
        exact_first_chunk=False,  # every chunk's rows are candidates
    )
    engine.precompute(CHUNKS)
    prompt = engine.tokenize(QUESTION, CHUNKS)
    trace = SelectionTrace()
    out, _ = fuse_prompt(engine, prompt, 0.2, trace)
    chunk_tokens = sum(len(c) for c in prompt.chunks)
    forced = len(prompt.ids) - len(prompt.head) - chunk_tokens
    sel = [set(trace.selections[layer].tolist()) for layer in (0, 1, 2)]
    assert sel[2] <= sel[1] <= sel[0]
    for s, r in zip(sel, (0.6, 0.4, 0.2)):
        assert len(s) == forced + round(r * chunk_tokens)
    assert out.rows_per_layer[0] == len(prompt.ids) - len(prompt.head)
    assert out.rows_per_layer[1:] == [len(s) for s in sel]


def test_tokens_without_cache_are_always_recomputed_and_last_token_is_last(tokenizer):
    engine = engine_for(tiny_model("qwen2"), tokenizer, ratio=0.05)
    engine.precompute(CHUNKS)
    prompt = engine.tokenize(QUESTION, CHUNKS)
    for mode in ("blend", "reuse"):
        out = engine.prefill(prompt, mode).fusion
        selected = set(out.selected.tolist())
        n = len(prompt.ids)
        assert set(range(n - len(prompt.tail), n)) <= selected
        assert int(out.selected[-1]) == n - 1
        start = len(prompt.head)
        for chunk in prompt.chunks[:-1]:
            start += len(chunk)
            assert set(range(start, start + len(prompt.separator))) <= selected
            start += len(prompt.separator)


def test_a_missing_chunk_is_recomputed_in_place_and_counted(tokenizer):
    engine = engine_for(tiny_model("llama"), tokenizer, ratio=1.0)
    engine.precompute(CHUNKS[:2])
    prompt = engine.tokenize(QUESTION, CHUNKS)
    missed = []
    engine.on_miss = missed.extend
    out = engine.prefill(prompt, "blend")
    assert (out.stats.chunk_hits, out.stats.chunk_misses) == (2, 1)
    assert missed == [CHUNKS[2]]
    full = engine.prefill(prompt, "full")
    torch.testing.assert_close(out.logits, full.logits, atol=1e-4, rtol=0)


def test_contiguous_tail_rows_take_the_causal_kernel_and_match_the_reference():
    torch.manual_seed(1)
    n, heads, kv_heads, dim = 300, 4, 2, 8
    positions = torch.arange(40, n)
    q = torch.randn(1, heads, positions.numel(), dim)
    k, v = torch.randn(1, kv_heads, n, dim), torch.randn(1, kv_heads, n, dim)
    for num_keys in (None, n):  # given the prompt length, the plan builds no masks at all
        plan = RowAttentionPlan(positions, heads // kv_heads, q.dtype, None, num_keys)
        assert plan.causal_start == 40
        assert (len(plan.blocks) == 0) == (num_keys == n)
        torch.testing.assert_close(
            attend_rows(q, k, v, plan, 0.3),
            _reference_rows(q, k, v, positions, 0.3),
            atol=1e-5,
            rtol=1e-5,
        )


def test_tail_rows_go_to_a_native_kernel_unless_the_causal_path_must_stay_exact():
    positions = torch.arange(40, 300)
    seen = []

    def kernel(q, k, v, rows, scaling):
        seen.append(rows)
        return _reference_rows(q, k, v, rows, scaling)

    exact = RowAttentionPlan(positions, 2, torch.float32, None, 300, kernel)
    assert exact.causal_start == 40 and exact.kernel is None  # ratio 1.0: HF's causal kernel
    fast = RowAttentionPlan(positions, 2, torch.float32, None, 300, kernel, exact_causal=False)
    assert fast.causal_start is None and fast.kernel is kernel and not fast.blocks
    torch.manual_seed(2)
    q = torch.randn(1, 4, positions.numel(), 8)
    k, v = torch.randn(1, 2, 300, 8), torch.randn(1, 2, 300, 8)
    torch.testing.assert_close(
        attend_rows(q, k, v, fast, 0.3), attend_rows(q, k, v, exact, 0.3), atol=1e-5, rtol=1e-5
    )
    assert len(seen) == 1 and torch.equal(seen[0], positions)
    windowed = RowAttentionPlan(positions, 2, torch.float32, 64, 300, kernel, exact_causal=False)
    assert windowed.kernel is None  # the kernels attend no sliding window


def test_a_maskless_causal_plan_refuses_keys_of_another_length():
    positions = torch.arange(40, 300)
    plan = RowAttentionPlan(positions, 2, torch.float32, None, num_keys=300)
    q = torch.randn(1, 4, positions.numel(), 8)
    k = v = torch.randn(1, 2, 320, 8)
    with pytest.raises(RagblendError, match="300 keys, got 320"):
        attend_rows(q, k, v, plan, 0.3)


def test_one_device_masked_call_matches_the_per_row_reference_and_the_blocks():
    # What a GPU runs after a selection: every row in one SDPA call with a mask built from the
    # positions on the device, never read on the host.
    positions, q, k, v = _scattered_rows()
    n = k.shape[2]
    for window in (None, 50):
        one = RowAttentionPlan(positions, 2, q.dtype, window, n, device_masks=True)
        blocks = RowAttentionPlan(positions, 2, q.dtype, window, n)
        assert len(one.blocks) == 1 and len(blocks.blocks) > 1
        got = attend_rows(q, k, v, one, 0.3)
        want = _reference_rows(q, k, v, positions, 0.3, window)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got, attend_rows(q, k, v, blocks, 0.3), atol=1e-5, rtol=1e-5)


def test_host_positions_keep_the_causal_path_with_device_masks():
    # Before any selection the host knows the rows: a contiguous tail still takes SDPA's
    # causal kernel (the one HF's full prefill runs), so ratio 1.0 stays exact.
    positions = torch.arange(40, 100)
    plan = RowAttentionPlan(
        positions, 2, torch.float32, None, 100, host_positions=range(40, 100), device_masks=True
    )
    assert plan.causal_only and not plan.blocks


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral-window", "gemma3"])
def test_blend_with_device_masks_equals_blend_with_blocks(family, tokenizer):
    name, _, windowed = family.partition("-")
    model = tiny_model(name, **({"sliding_window": 24} if windowed else {}))
    got = {}
    for attention in ("sdpa", "masked"):
        engine = engine_for(model, tokenizer, ratio=0.3, row_attention=attention)
        assert engine.row_attention == attention
        engine.precompute(CHUNKS)
        got[attention] = engine.prefill(engine.tokenize(QUESTION, CHUNKS), mode="blend")
    blocks, masked = got["sdpa"], got["masked"]
    assert torch.equal(blocks.fusion.selected, masked.fusion.selected)
    torch.testing.assert_close(masked.logits, blocks.logits, atol=1e-5, rtol=0)
    for layer in range(model.config.num_hidden_layers):
        k, v = masked.cache.layers[layer].keys, masked.cache.layers[layer].values
        torch.testing.assert_close(k, blocks.cache.layers[layer].keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(v, blocks.cache.layers[layer].values, atol=1e-5, rtol=0)


def test_a_check_layer_keeps_every_forced_row_and_its_budget_in_position_order():
    from ragblend.fusion.fusor import select_rows
    from ragblend.fusion.selectors import CheckLayer

    torch.manual_seed(0)
    active = torch.tensor(sorted(torch.randperm(200)[:90].tolist()))
    is_forced = torch.zeros(90, dtype=torch.bool)
    is_forced[[0, 7, 40, 89]] = True
    candidates = (~is_forced).nonzero().squeeze(1)
    check = CheckLayer(1, None, None, None, None, active, 150, 1.0, candidates)  # type: ignore[arg-type]
    scores = torch.randn(candidates.numel())

    class Fixed:
        name = "fixed"

        def scores(self, check):
            return scores

    keep, _ = select_rows(Fixed(), check, is_forced, 0.25, 80)
    chosen = candidates[torch.topk(scores, 20).indices]
    want = torch.cat([is_forced.nonzero().squeeze(1), chosen]).sort().values
    assert torch.equal(keep, want)
