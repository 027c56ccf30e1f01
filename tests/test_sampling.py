"""The shared next-token choice: penalties as vLLM defines them, top-k, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from ragblend.decode.sampling import (
    Sampler,
    SamplingParams,
    apply_penalties,
    greedy_choices,
    token_logprobs,
)
from ragblend.errors import RagblendError


def test_penalties_match_a_hand_computation():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    # prompt has token 0; the output so far is 1, 3, 3
    out = apply_penalties(logits, prompt_ids=[0], output_ids=[1, 3, 3], params=params)
    expected = [
        2.0 / 2,  # seen in the prompt, positive: divided; not in the output
        -1.0 * 2 - 0.5 - 0.25 * 1,  # in the output once, negative: multiplied
        0.5,  # never seen
        3.0 / 2 - 0.5 - 0.25 * 2,  # in the output twice
        -2.0,  # never seen
    ]
    assert out.tolist() == pytest.approx(expected)


def test_presence_and_frequency_penalties_ignore_the_prompt():
    logits = torch.tensor([1.0, 1.0])
    params = SamplingParams(presence_penalty=1.0, frequency_penalty=1.0)
    assert apply_penalties(logits, [0, 0, 1], [], params).tolist() == [1.0, 1.0]


def test_no_penalty_returns_the_logits_unchanged():
    logits = torch.tensor([1.0, 2.0])
    assert apply_penalties(logits, [0], [1], SamplingParams()) is logits


def test_greedy_choice_applies_the_penalties_first():
    logits = torch.tensor([5.0, 4.0, 0.0])
    plain, penalized = Sampler(SamplingParams()), Sampler(SamplingParams(frequency_penalty=2.0))
    assert [plain(logits) for _ in range(2)] == [0, 0]
    # after choosing 0 once, its logit is 5 - 2 = 3 < 4: the next choice is 1
    assert [penalized(logits) for _ in range(2)] == [0, 1]


def test_a_batchs_greedy_choices_are_each_rows_own_samplers_choice():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 1000, generator=gen)
    logits[1, [7, 300]] = 9.0  # a tie: the first index, alone or batched
    logits[3, [999, 2]] = 9.0
    alone = [Sampler(SamplingParams())(row) for row in logits]
    assert alone[1] == 7 and alone[3] == 2
    assert greedy_choices(logits, [True] * 5) == alone
    assert greedy_choices(logits, [True, False, False, True, True]) == [
        alone[0],
        None,
        None,
        alone[3],
        alone[4],
    ]
    assert greedy_choices(logits, [False] * 5) == [None] * 5
    # bf16 logits (widened before the argmax): bf16's own argmax, its many ties included
    coarse = (logits * 2).round().bfloat16()
    assert greedy_choices(coarse, [True] * 5) == [int(torch.argmax(row)) for row in coarse]
    assert [Sampler(SamplingParams())(row) for row in coarse] == greedy_choices(coarse, [True] * 5)


def test_a_sampler_takes_the_batchs_argmax_only_where_it_is_its_own_choice():
    logits = torch.tensor([5.0, 4.0, 0.0])
    plain = Sampler(SamplingParams())
    assert plain.plain_greedy and plain(logits, argmax=0) == 0 and plain.output_ids == [0]
    penalized = Sampler(SamplingParams(frequency_penalty=2.0))
    assert not penalized.plain_greedy
    # the batch's argmax (0) is not a penalized request's choice: it chooses for itself
    assert [penalized(logits, argmax=0) for _ in range(2)] == [0, 1]
    assert not Sampler(SamplingParams(temperature=1.0)).plain_greedy


def test_repetition_penalty_reads_the_prompt():
    logits = torch.tensor([3.0, 2.0])
    assert Sampler(SamplingParams(repetition_penalty=2.0), prompt_ids=[0])(logits) == 1
    assert Sampler(SamplingParams(repetition_penalty=2.0), prompt_ids=[1])(logits) == 0


def test_top_k_one_samples_the_argmax():
    logits = torch.tensor([0.1, 0.3, 0.2])
    sampler = Sampler(SamplingParams(temperature=1.5, top_k=1, seed=3))
    assert {sampler(logits) for _ in range(20)} == {1}


def test_seeded_sampling_repeats():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))

    def draw() -> list[int]:
        sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.9, seed=7))
        return [sampler(logits) for _ in range(10)]

    assert draw() == draw()


@pytest.mark.parametrize(
    "bad",
    [
        {"repetition_penalty": 0.0},
        {"presence_penalty": 2.5},
        {"frequency_penalty": -3.0},
        {"top_k": -2},
    ],
)
def test_out_of_range_parameters_are_refused(bad):
    with pytest.raises(RagblendError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_token_logprobs_are_the_log_softmax_of_the_raw_logits():
    logits = torch.tensor([1.0, 2.0, 3.0])
    lp = token_logprobs(logits, token=0, top_n=2)
    norm = math.log(math.exp(1) + math.exp(2) + math.exp(3))
    assert lp.logprob == pytest.approx(1 - norm)
    assert [t for t, _ in lp.top] == [2, 1]
    assert lp.top[0][1] == pytest.approx(3 - norm)
