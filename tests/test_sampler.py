"""The batched sampler: row-invariant, seeded, greedy without randomness, no readback."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.engine import draw as draw_module
from nanoserve.engine import sampler as sampler_module
from nanoserve.engine.sampler import (
    BatchedSampler,
    RowEdits,
    SampledTokens,
    SamplingBatch,
    SamplingRow,
    uniform_from_counter,
)
from nanoserve.sampling_params import SamplingParams

VOCAB = 2048
EOS = 2


def rows_of(params: Sequence[SamplingParams], *, seeds: Sequence[int] | None = None,
            positions: Sequence[int] | None = None, prompt: Sequence[int] = (5, 6, 7),
            outputs: Sequence[Sequence[int]] | None = None) -> list[SamplingRow]:
    n = len(params)
    seeds = seeds if seeds is not None else range(n)
    positions = positions if positions is not None else [0] * n
    outputs = outputs if outputs is not None else [[]] * n
    return [SamplingRow(p, seed=s, position=pos, prompt_ids=prompt, output_ids=out)
            for p, s, pos, out in zip(params, seeds, positions, outputs, strict=True)]


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow], eos: Sequence[int] = (EOS,)) -> SampledTokens:
    batch = SamplingBatch.build(rows, vocab_size=logits.shape[-1], eos_token_ids=eos, device="cpu")
    return BatchedSampler()(logits, batch)


def random_logits(rows: int, vocab: int = VOCAB, *, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


params_strategy = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.5, 1.0, 1.7]),
    top_k=st.sampled_from([-1, 1, 5, 40]),
    top_p=st.sampled_from([1.0, 0.95, 0.6]),
    min_p=st.sampled_from([0.0, 0.05]),
    typical_p=st.sampled_from([1.0, 1.0, 0.9, 0.3]),
    top_n_sigma=st.sampled_from([-1.0, -1.0, 1.0, 2.5]),
    p_less=st.sampled_from([False, False, True]),
    logprobs=st.sampled_from([None, 0, 3, 7]),
    repetition_penalty=st.sampled_from([1.0, 1.3]),
    frequency_penalty=st.sampled_from([0.0, 0.7]),
    presence_penalty=st.sampled_from([0.0, -0.5]),
    logit_bias=st.sampled_from([{}, {3: 4.0, 9: -50.0}]),
    min_tokens=st.sampled_from([0, 3]),
    max_tokens=st.just(16),
)


def row_strategy(vocab: int) -> st.SearchStrategy[SamplingRow]:
    ids = st.lists(st.integers(0, vocab - 1), max_size=12)
    return st.builds(SamplingRow, params=params_strategy, seed=st.integers(0, 2**63 - 1),
                     position=st.integers(0, 6), prompt_ids=ids, output_ids=ids)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), vocab=st.sampled_from([VOCAB, 1000]), size=st.integers(1, 33),
       bf16_ties=st.booleans(), logits_seed=st.integers(0, 2**31))
def test_a_row_in_any_batch_gives_bit_identically_its_solo_token_and_logprobs(
        data, vocab, size, bf16_ties, logits_seed):
    rows = data.draw(st.lists(row_strategy(vocab), min_size=size, max_size=size))
    index = data.draw(st.integers(0, size - 1))
    logits = random_logits(size, vocab, seed=logits_seed)
    if bf16_ties:  # real models emit bf16 logits: many exact ties
        logits = logits.bfloat16().float()
    crowd = sample(logits, rows)
    alone = sample(logits[index:index + 1].clone(), rows[index:index + 1])
    assert crowd.token_ids[index].item() == alone.token_ids[0].item()
    if rows[index].params.logprobs is not None:
        assert torch.equal(crowd.logprobs[index], alone.logprobs[0])
        asked = rows[index].params.logprobs
        if asked:
            assert torch.equal(crowd.top_ids[index, :asked], alone.top_ids[0, :asked])
            assert torch.equal(crowd.top_logprobs[index, :asked], alone.top_logprobs[0, :asked])


def test_alternatives_tied_at_the_cut_are_the_same_whatever_the_batch_asks_for():
    """Tied values at the k-th place: a row asking 3 alternatives beside a row asking 8 (the
    batch takes 8) must list the tokens it lists alone: the tie goes to the smaller ids."""
    logits = torch.zeros(2, 64)
    logits[:, 40] = 2.0
    logits[:, [50, 7, 33, 12, 61]] = 1.0  # one leader, then five tied for the next places
    rows = rows_of([SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0, logprobs=8)])
    crowd, alone = sample(logits, rows), sample(logits[:1].clone(), rows[:1])
    assert alone.top_ids[0].tolist() == [40, 7, 12]
    assert torch.equal(crowd.top_ids[0, :3], alone.top_ids[0])
    assert crowd.top_ids[1, :6].tolist() == [40, 7, 12, 33, 50, 61]


def test_top_k_one_at_temperature_1_7_equals_greedy():
    logits = random_logits(16)
    top1 = sample(logits, rows_of([SamplingParams(temperature=1.7, top_k=1)] * 16))
    greedy = sample(logits, rows_of([SamplingParams(temperature=0)] * 16))
    assert torch.equal(top1.token_ids, greedy.token_ids)


def test_temperature_zero_takes_the_first_argmax_even_among_ties():
    logits = random_logits(8).bfloat16().float()
    logits[3, [10, 700, 1500]] = 100.0  # a three-way tie: the lowest id wins
    picked = sample(logits, rows_of([SamplingParams(temperature=0)] * 8)).token_ids
    assert torch.equal(picked, logits.argmax(-1))
    assert picked[3].item() == 10


def test_an_all_greedy_batch_never_draws_a_uniform(monkeypatch):
    def no_randomness(*_):
        raise AssertionError("a greedy row consumed randomness")

    monkeypatch.setattr(sampler_module, "uniform_from_counter", no_randomness)
    greedy = [SamplingParams(temperature=0), SamplingParams(top_k=1, logprobs=2),
              SamplingParams(temperature=1e-7, repetition_penalty=1.5)]
    sample(random_logits(3), rows_of(greedy))


def test_a_greedy_neighbour_does_not_change_seeded_rows():
    logits = random_logits(4)
    seeded = SamplingParams(temperature=0.9, top_p=0.9)
    mixed = sample(logits, rows_of([seeded, SamplingParams(temperature=0), seeded, seeded],
                                   seeds=[7, 8, 9, 10]))
    alone = sample(logits[[0, 2, 3]], rows_of([seeded] * 3, seeds=[7, 9, 10]))
    assert torch.equal(mixed.token_ids[[0, 2, 3]], alone.token_ids)


def test_the_same_seed_and_position_give_the_same_token():
    logits = random_logits(1, seed=3).expand(12, -1).contiguous()
    params = [SamplingParams(temperature=1.0)] * 12
    first = sample(logits, rows_of(params, seeds=[42] * 12, positions=[5] * 12)).token_ids
    assert len(set(first.tolist())) == 1
    again = sample(logits, rows_of(params, seeds=[42] * 12, positions=[5] * 12)).token_ids
    assert torch.equal(first, again)


def test_successive_positions_draw_independently_on_a_flat_distribution():
    flat = torch.zeros(20, VOCAB)
    draws = sample(flat, rows_of([SamplingParams()] * 20, seeds=[42] * 20,
                                 positions=range(20))).token_ids.tolist()
    assert len(set(draws)) > 15  # re-seeding with the seed alone would give one token 20 times


def splitmix64(seed: int, count: int) -> list[int]:
    """The reference generator, in plain Python integers."""
    mask, state, out = (1 << 64) - 1, seed, []
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        out.append(z ^ (z >> 31))
    return out


@pytest.mark.parametrize("seed", [0, 1, 42, 2**62 + 12345, 2**63 - 1])
def test_the_uniform_is_the_position_th_output_of_splitmix64(seed):
    expected = [(value >> 11) * 2.0**-53 for value in splitmix64(seed, 50)]
    got = uniform_from_counter(torch.full((50,), seed), torch.arange(50))
    assert got.dtype == torch.float64
    assert got.tolist() == expected


def reference_keep(logits: torch.Tensor, *, temperature: float = 1.0, top_n_sigma: float = -1.0,
                   top_k: int = -1, typical_p: float = 1.0, top_p: float = 1.0,
                   min_p: float = 0.0, p_less: bool = False) -> torch.Tensor:
    """The whole filter chain on one row, the slow way: float64, full sorts, and each filter
    renormalizing over what the ones before it kept."""
    scaled = logits.double() / temperature
    keep = scaled > -torch.inf

    def survivors() -> torch.Tensor:
        return torch.softmax(scaled.masked_fill(~keep, -torch.inf), -1)

    if top_n_sigma > 0:
        finite = scaled[scaled.isfinite()]
        keep &= scaled >= finite.max() - top_n_sigma * finite.std(unbiased=False)
    if top_k > 0:
        keep &= scaled >= scaled[keep].sort(descending=True).values[min(top_k, int(keep.sum())) - 1]
    if typical_p < 1:
        log_q = torch.log_softmax(scaled.masked_fill(~keep, -torch.inf), -1)
        entropy = -(log_q.exp() * log_q).nansum()
        shifted = (-log_q - entropy).abs()
        order = shifted.sort().indices
        running = log_q.exp()[order].cumsum(0)
        keep &= shifted <= shifted[order[min(int((running < typical_p).sum()), len(order) - 1)]]
    if top_p < 1:
        q = survivors()
        ordered = q.sort(descending=True).values
        keep &= q >= ordered[min(int((ordered.cumsum(0) < top_p).sum()), len(ordered) - 1)]
    q = survivors()
    keep &= q >= min_p * q.max()
    if p_less:
        q = survivors()
        keep &= q >= (q * q).sum()
    return keep


def reference_probs(logits: torch.Tensor, **filters: float) -> torch.Tensor:
    """The filtered, renormalized softmax, from `reference_keep`."""
    filtered = torch.softmax(logits.double() / filters.get("temperature", 1.0), -1)
    filtered = filtered * reference_keep(logits, **filters)
    return filtered / filtered.sum()


def empirical(logits_row: torch.Tensor, params: SamplingParams, draws: int = 8000) -> torch.Tensor:
    """Frequencies of `draws` tokens drawn with seeds 0..draws-1: fixed, so it cannot flake."""
    counts = Counter()
    for start in range(0, draws, 1000):
        logits = logits_row.expand(1000, -1).contiguous()
        rows = rows_of([params] * 1000, seeds=range(start, start + 1000))
        counts.update(sample(logits, rows).token_ids.tolist())
    freq = torch.zeros(logits_row.shape[-1], dtype=torch.float64)
    for token, count in counts.items():
        freq[token] = count / draws
    return freq


# A peaked, LM-like row: a few likely tokens, then a long power-law tail, shuffled over ids.
PEAKED = torch.log(1.0 / torch.arange(1, 257, dtype=torch.float64) ** 1.3)[
    torch.randperm(256, generator=torch.Generator().manual_seed(1))].float()


@pytest.mark.parametrize("filters", [
    {"temperature": 0.7},
    {"temperature": 1.3, "top_k": 12},
    {"temperature": 1.0, "top_p": 0.6},
    {"temperature": 0.8, "top_p": 0.85},
    {"temperature": 1.2, "min_p": 0.05},
    {"temperature": 1.0, "top_k": 30, "top_p": 0.7},
    {"temperature": 1.0, "typical_p": 0.5},
    {"temperature": 1.5, "top_n_sigma": 1.0},
    {"temperature": 1.0, "top_n_sigma": 1.0, "top_p": 0.9},
    {"temperature": 0.9, "top_n_sigma": 2.0, "top_k": 20, "typical_p": 0.8, "top_p": 0.9, "min_p": 0.02},
    {"temperature": 1.0, "p_less": True},
    {"temperature": 1.4, "top_k": 40, "p_less": True},
], ids=str)
def test_draws_follow_the_filtered_renormalized_softmax(filters):
    expected = reference_probs(PEAKED, **filters)
    got = empirical(PEAKED, SamplingParams(**filters))
    assert torch.all(got[expected == 0] == 0), "drew a token the filters remove"
    total_variation = 0.5 * (got - expected).abs().sum().item()
    assert total_variation < 0.04


def test_top_p_cut_by_radix_select_equals_the_full_sort_cut():
    logits = torch.cat([random_logits(24, seed=5), random_logits(8, seed=6).bfloat16().float(),
                        torch.zeros(2, VOCAB)])
    top_p = torch.tensor([0.05, 0.3, 0.5, 0.9, 0.97, 0.999] * 5 + [0.5] * 4, dtype=torch.float64)
    probs = torch.softmax(logits, -1)
    cut = draw_module._top_p_by_radix(probs, draw_module._mass(probs), top_p)
    for row in range(logits.shape[0]):
        mass = draw_module._mass(probs[row])
        ordered = mass.sort(descending=True).values
        need = max(1, min(int(torch.ceil(top_p[row] * mass.sum().double())), int(mass.sum())))
        crossing = int((ordered.cumsum(0) < need).sum())
        assert draw_module._mass(cut[row]).item() == ordered[crossing].item()
        assert (probs[row] >= cut[row]).sum() >= 1


def test_masked_tokens_are_never_drawn_and_nothing_is_nan():
    logits = random_logits(6)
    logits[:, 100:] = -torch.inf  # only ids 0..99 are allowed
    logits[5] = -torch.inf  # nothing allowed at all
    params = [SamplingParams(temperature=2.0), SamplingParams(top_p=1e-6),
              SamplingParams(min_p=1.0), SamplingParams(top_k=500, top_p=0.999),
              SamplingParams(temperature=5.0, logprobs=3), SamplingParams(top_p=0.5, logprobs=2)]
    for seed in range(30):
        out = sample(logits, rows_of(params, seeds=[seed] * 6))
        assert torch.all(out.token_ids[:5] < 100)
        assert 0 <= out.token_ids[5].item() < VOCAB
        assert not torch.isnan(out.logprobs).any() and not torch.isnan(out.top_logprobs).any()
    best = logits[:4].argmax(-1)
    narrow = sample(logits[1:3], rows_of(params[1:3])).token_ids
    assert torch.equal(narrow, best[1:3]), "a filter that keeps nothing still keeps the argmax"


def greedy_pick(logits: torch.Tensor, **fields: object) -> int:
    outputs = [fields.pop("output_ids", [])]
    prompt = fields.pop("prompt_ids", (5,))
    return sample(logits, rows_of([SamplingParams(temperature=0, **fields)], prompt=prompt,
                                  outputs=outputs)).token_ids.item()


def test_penalties_and_logit_bias_move_the_distribution_the_right_way():
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, 10], logits[0, 11], logits[0, 12] = 4.0, 3.0, -1.0
    assert greedy_pick(logits) == 10
    assert greedy_pick(logits, logit_bias={10: -2.0}) == 11
    assert greedy_pick(logits, logit_bias={12: 6.0}) == 12
    assert greedy_pick(logits, repetition_penalty=1.5, prompt_ids=[10]) == 11  # 4 / 1.5 < 3
    assert greedy_pick(logits, repetition_penalty=1.2, prompt_ids=[10]) == 10  # 4 / 1.2 > 3
    assert greedy_pick(logits, frequency_penalty=0.4, output_ids=[10, 10, 10]) == 11
    assert greedy_pick(logits, frequency_penalty=0.4, output_ids=[10, 10]) == 10
    assert greedy_pick(logits, presence_penalty=1.5, output_ids=[10, 10]) == 11
    assert greedy_pick(logits, presence_penalty=-2.0, output_ids=[11]) == 11
    negative = torch.full((1, VOCAB), -9.0)
    negative[0, 20], negative[0, 21] = -1.0, -1.1
    assert greedy_pick(negative, repetition_penalty=1.2, prompt_ids=[20]) == 21  # -1 * 1.2 < -1.1


def test_frequency_penalty_lowers_the_share_of_a_repeated_token():
    logits = torch.zeros(1, 8)
    plain = empirical(logits[0], SamplingParams(), draws=4000)
    params = SamplingParams(frequency_penalty=0.5)
    counts = Counter()
    rows = rows_of([params] * 4000, seeds=range(4000), outputs=[[3, 3]] * 4000)
    counts.update(sample(logits.expand(4000, -1).contiguous(), rows).token_ids.tolist())
    assert counts[3] / 4000 < plain[3].item() - 0.05


def test_min_tokens_masks_the_stop_ids_until_it_is_reached():
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS], logits[0, 99] = 50.0, 40.0
    assert greedy_pick(logits, min_tokens=0) == EOS
    early = sample(logits, rows_of([SamplingParams(temperature=0, min_tokens=2)], positions=[1]))
    assert early.token_ids.item() == 99
    reached = sample(logits, rows_of([SamplingParams(temperature=0, min_tokens=2)], positions=[2]))
    assert reached.token_ids.item() == EOS
    stop_id = sample(logits, rows_of([SamplingParams(temperature=0, min_tokens=2, ignore_eos=True,
                                                     stop_token_ids=[99])], positions=[0]))
    assert stop_id.token_ids.item() == EOS  # ignore_eos: eos is no stop, 99 is


def test_logprobs_are_read_from_the_raw_logits_before_any_filter():
    logits = random_logits(3)
    params = [SamplingParams(temperature=0.3, top_k=4, logprobs=5, repetition_penalty=1.8),
              SamplingParams(temperature=0, logprobs=0, logit_bias={7: 30.0}),
              SamplingParams(temperature=1.0)]
    out = sample(logits, rows_of(params, prompt=range(50)))
    expected = torch.log_softmax(logits, -1)
    assert torch.equal(out.logprobs, expected.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_ids.shape == (3, 5)
    assert torch.equal(out.top_logprobs, expected.topk(5, -1).values)
    assert out.token_ids[1].item() == 7


def test_bf16_logits_sample_like_their_float32_widening():
    logits = random_logits(5).bfloat16()
    params = [SamplingParams(temperature=0.8, top_p=0.9, logprobs=2)] * 5
    as_bf16 = sample(logits, rows_of(params))
    as_f32 = sample(logits.float(), rows_of(params))
    assert torch.equal(as_bf16.token_ids, as_f32.token_ids)
    assert torch.equal(as_bf16.logprobs, as_f32.logprobs)


def test_the_sampler_reads_nothing_back_to_the_host(monkeypatch):
    logits = random_logits(11).bfloat16()
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_p=0.9, logprobs=4),
              SamplingParams(top_k=20, top_p=0.8), SamplingParams(min_p=0.1, seed=3),
              SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3,
                             logit_bias={4: 2.0}, min_tokens=4, logprobs=0),
              SamplingParams(top_k=1), SamplingParams(temperature=1.5),
              SamplingParams(top_k=3000, top_p=0.5), SamplingParams(typical_p=0.7, top_k=30),
              SamplingParams(top_n_sigma=1.0, top_p=0.9), SamplingParams(typical_p=0.5, top_n_sigma=2.0)]
    batch = SamplingBatch.build(rows_of(params, outputs=[[1, 2, 2]] * 11), vocab_size=VOCAB,
                                eos_token_ids=[EOS], device="cpu")

    def readback(*_args, **_kwargs):
        raise AssertionError("the sampler read a tensor back to the host")

    for name in ("tolist", "item", "__int__", "__bool__", "__index__", "__float__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, readback)
    monkeypatch.setattr(torch, "nonzero", readback)
    out = BatchedSampler()(logits, batch)
    monkeypatch.undo()
    assert out.token_ids.shape == (11,) and out.top_ids.shape == (11, 4)


class CountingList(list):
    """A list that counts how many of its elements were read (iterated or indexed)."""

    def __init__(self, items: Sequence) -> None:
        super().__init__(items)
        self.reads = 0

    def __iter__(self):
        self.reads += len(self)
        return super().__iter__()

    def __getitem__(self, key):
        got = super().__getitem__(key)
        self.reads += len(got) if isinstance(key, slice) else 1
        return got


def test_a_step_reads_only_the_new_tokens_not_the_bias_prompt_or_earlier_output():
    params = SamplingParams(temperature=0.8, repetition_penalty=1.3, frequency_penalty=0.5,
                            presence_penalty=0.2, logit_bias=dict.fromkeys(range(1000), 1.5))
    bias = CountingList(params.logit_bias)
    object.__setattr__(params, "logit_bias", bias)  # frozen: swapped in only to count its reads
    prompt, output = CountingList(range(500, 1500)), CountingList([])
    edits = RowEdits(params, prompt, VOCAB, "cpu")
    logits = random_logits(1)
    reads_at_build = bias.reads + prompt.reads
    for step in range(20):
        row = SamplingRow(params, seed=1, position=step, prompt_ids=prompt, output_ids=output, edits=edits)
        token = BatchedSampler()(logits, SamplingBatch.build([row], vocab_size=VOCAB, eos_token_ids=[EOS],
                                                              device="cpu")).token_ids
        list.append(output, int(token))
    assert bias.reads + prompt.reads == reads_at_build  # read once, when the request's edits were built
    assert output.reads == 19  # each step reads only the token generated since the last


def test_edits_kept_across_steps_pick_as_edits_built_afresh_each_step():
    params = SamplingParams(temperature=0.9, repetition_penalty=1.4, frequency_penalty=0.6,
                            presence_penalty=-0.4, logit_bias={3: 5.0, 70: -2.0}, seed=4)
    logits = random_logits(1, scale=1.0)
    kept, output = RowEdits(params, [3, 4, 5], VOCAB, "cpu"), []
    for step in range(12):
        kept_row = SamplingRow(params, 4, step, [3, 4, 5], output, edits=kept)
        fresh_row = SamplingRow(params, 4, step, [3, 4, 5], list(output))
        token = sample(logits, [kept_row]).token_ids
        assert torch.equal(token, sample(logits, [fresh_row]).token_ids)
        output.append(int(token))


FILTER_NAMES = ("temperature", "top_n_sigma", "top_k", "typical_p", "top_p", "min_p")
FILTER_GRID = [dict(zip(FILTER_NAMES, values, strict=True))
               for values in itertools.product([0.7, 1.3], [-1.0, 0.5, 1.0, 2.0], [-1, 5, 40],
                                               [1.0, 0.2, 0.9], [1.0, 0.9, 0.5], [0.0, 0.1])]


def kept_tokens(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """[rows, vocab] bool: the tokens each (drawing) row may draw, from the sampler itself."""
    batch = SamplingBatch.build(rows_of(params), vocab_size=logits.shape[-1], eos_token_ids=(),
                                device="cpu")
    return draw_module.kept_mass(logits, batch.draw) > 0


def test_the_kept_tokens_of_every_filter_combination_match_the_float64_chain():
    logits = random_logits(len(FILTER_GRID), 256, seed=21, scale=2.0)
    logits[::5] = logits[::5].bfloat16().float()  # exact ties too
    kept = kept_tokens(logits, [SamplingParams(**filters) for filters in FILTER_GRID])
    for row, filters in enumerate(FILTER_GRID):
        expected = reference_keep(logits[row], **filters)
        assert torch.equal(kept[row], expected), filters


@pytest.mark.parametrize("filters", [{}, {"temperature": 0.6}, {"temperature": 2.0, "top_k": 40},
                                     {"top_n_sigma": 1.0}, {"typical_p": 0.9, "top_p": 0.95},
                                     {"top_p": 0.8, "min_p": 0.05}], ids=str)
def test_p_less_keeps_exactly_the_tokens_at_or_above_the_sum_of_squared_probabilities(filters):
    logits = random_logits(16, 512, seed=8, scale=2.5)
    logits[::4] = logits[::4].bfloat16().float()  # exact ties too
    kept = kept_tokens(logits, [SamplingParams(p_less=True, **filters)] * 16)
    for row in range(16):
        assert torch.equal(kept[row], reference_keep(logits[row], p_less=True, **filters))
    assert torch.all(kept.sum(-1) >= 1)


def test_p_less_keeps_every_token_of_a_uniform_row():
    # sum(p**2) == max(p) there: rounding must never lift the cut above the tokens themselves.
    kept = kept_tokens(torch.zeros(3, 768), [SamplingParams(p_less=True)] * 3)
    assert torch.all(kept)


def test_top_n_sigma_then_top_p_renormalizes_over_the_survivors():
    # The trap: top_p measured against the mass before top_n_sigma needs more than is left.
    logits = random_logits(64, seed=4)
    params = [SamplingParams(top_n_sigma=1.0, top_p=0.9)] * 64
    kept = kept_tokens(logits, params)
    alone = kept_tokens(logits, [SamplingParams(top_n_sigma=1.0)] * 64)
    assert torch.all(kept.sum(-1) >= 1) and torch.all(kept <= alone)
    assert torch.any(kept.sum(-1) < alone.sum(-1)), "top_p cut nothing after top_n_sigma"


@settings(max_examples=80, deadline=None)
@given(data=st.data(), logits_seed=st.integers(0, 2**31), bf16_ties=st.booleans(),
       masked=st.integers(0, 250), scale=st.sampled_from([0.01, 1.0, 5.0, 40.0]))
def test_no_valid_combination_of_filters_empties_a_row(data, logits_seed, bf16_ties, masked, scale):
    filters = st.builds(
        SamplingParams,
        temperature=st.floats(1e-4, 10.0),
        top_n_sigma=st.one_of(st.just(-1.0), st.floats(1e-6, 20.0)),
        top_k=st.one_of(st.just(-1), st.integers(2, 300)),
        typical_p=st.one_of(st.just(1.0), st.floats(1e-9, 1.0)),
        top_p=st.one_of(st.just(1.0), st.floats(1e-9, 1.0)),
        min_p=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
    )
    params = data.draw(st.lists(filters, min_size=1, max_size=8))
    logits = random_logits(len(params), 256, seed=logits_seed, scale=scale)
    logits[:, 256 - masked:] = -torch.inf  # what min_tokens or logit_bias can leave: at least 6 tokens
    if bf16_ties:
        logits = logits.bfloat16().float()
    kept = kept_tokens(logits, params)
    assert torch.all(kept.sum(-1) >= 1)
    picked = sample(logits, rows_of(params)).token_ids
    assert torch.all(kept.gather(1, picked[:, None]))


def test_rows_without_typical_p_or_top_n_sigma_keep_their_bits_beside_rows_with_them():
    logits = random_logits(len(FILTER_GRID), seed=8)
    params = [SamplingParams(**filters, logprobs=2) for filters in FILTER_GRID]
    off = [dataclasses.replace(p, typical_p=1.0, top_n_sigma=-1.0) for p in params]
    plain = [i for i, p in enumerate(params) if p == off[i]]
    seeds = range(1000, 1000 + len(params))
    with_modes = sample(logits, rows_of(params, seeds=seeds))
    without = sample(logits, rows_of(off, seeds=seeds))
    assert torch.equal(with_modes.token_ids[plain], without.token_ids[plain])
    assert torch.equal(kept_tokens(logits, params)[plain], kept_tokens(logits, off)[plain])
    assert torch.equal(with_modes.logprobs[plain], without.logprobs[plain])


def test_a_seeded_shaped_row_draws_the_same_token_alone_or_in_a_mixed_crowd():
    logits = random_logits(len(FILTER_GRID), seed=9).bfloat16().float()
    params = [SamplingParams(**filters) for filters in FILTER_GRID]
    seeds = range(7, 7 + len(params))
    crowd = sample(logits, rows_of(params, seeds=seeds)).token_ids
    for i in range(0, len(params), 7):
        alone = sample(logits[i:i + 1].clone(), rows_of(params[i:i + 1], seeds=[seeds[i]]))
        assert crowd[i].item() == alone.token_ids.item()


def test_top_n_sigma_keeps_the_tokens_within_n_deviations_of_the_max():
    logits = torch.full((1, 64), -torch.inf)
    logits[0, :5] = torch.tensor([10.0, 9.0, 8.0, 7.0, 0.0])  # std of the five finite: 3.54
    kept = kept_tokens(logits, [SamplingParams(top_n_sigma=0.6)])[0]
    assert kept[:5].tolist() == [True, True, True, False, False]  # the cut is 10 - 2.12


def test_typical_p_can_drop_the_most_likely_token():
    # One token at 0.3, 70 at 0.01: the entropy is 3.6 nats, -log 0.3 = 1.2 lies 2.4 from it and
    # -log 0.01 = 4.6 only 1.0, so the 0.01s come first (all of them: ties at the cut are kept).
    probs = torch.tensor([0.3] + [0.01] * 70)
    kept = kept_tokens(probs.log()[None], [SamplingParams(typical_p=0.4)])[0]
    assert not kept[0] and kept[1:].all()
    assert torch.equal(kept, reference_keep(probs.log(), typical_p=0.4))


def reference_edited(logits_row: Sequence[float], prompt: Sequence[int], output: Sequence[int],
                     params: SamplingParams) -> list[float]:
    """Penalties and logit_bias as their definitions read, in plain Python floats: the
    repetition penalty over the tokens of the prompt and the output, frequency and presence
    over the output's counts only, then the bias."""
    edited = list(logits_row)
    if params.repetition_penalty != 1:
        for token in set(prompt) | set(output):
            penalty, value = params.repetition_penalty, edited[token]
            edited[token] = value / penalty if value > 0 else value * penalty
    for token, count in Counter(output).items():
        edited[token] -= params.frequency_penalty * count + params.presence_penalty
    for token, amount in params.logit_bias:
        edited[token] += amount
    return edited


def test_penalties_and_bias_in_a_crowd_pick_what_the_plain_python_definition_picks():
    # Logits peaked on a few ids that every prompt and output draws from, so each penalty
    # decides the argmax often; every row has its own prompt, output and penalties.
    generator = torch.Generator().manual_seed(17)
    size, hot, vocab = 96, 12, 256
    logits = torch.randn(size, vocab, generator=generator)
    logits[:, :hot] += 3.0

    def draw(options: Sequence, count: int = 1) -> list:
        return [options[i] for i in torch.randint(len(options), (count,), generator=generator).tolist()]

    params, prompts, outputs = [], [], []
    for _ in range(size):
        params.append(SamplingParams(
            temperature=0, repetition_penalty=draw([1.0, 1.6, 0.6])[0],
            frequency_penalty=draw([0.0, 0.9, -0.7])[0], presence_penalty=draw([0.0, 1.2, -0.8])[0],
            logit_bias=dict(zip(draw(range(hot), 2), draw([0.0, 1.5, -1.5], 2), strict=True))))
        prompts.append(draw(range(hot), 6))
        outputs.append(draw(range(hot), 5))
    rows = [SamplingRow(p, seed=i, position=5, prompt_ids=prompt, output_ids=out)
            for i, (p, prompt, out) in enumerate(zip(params, prompts, outputs, strict=True))]
    picked = sample(logits, rows).token_ids.tolist()
    moved = 0
    for i, row in enumerate(rows):
        edited = reference_edited(logits[i].tolist(), row.prompt_ids, row.output_ids, row.params)
        expected = torch.tensor(edited, dtype=torch.float64)
        top2 = expected.topk(2).values
        assert top2[0] - top2[1] > 1e-4, "a near tie: choose another generator seed"
        assert picked[i] == expected.argmax().item(), (i, row.params, row.prompt_ids, row.output_ids)
        moved += expected.argmax().item() != logits[i].argmax().item()
    assert moved > size // 3, "the edits rarely decided the pick: the test would not see them"


def test_each_rows_logit_bias_moves_its_own_row_only_in_a_crowd_of_different_biases():
    size = 10
    logits = random_logits(size, seed=23)
    greedy = [SamplingParams(temperature=0, logit_bias={100 + 7 * i: 40.0, int(logits[i].argmax()): -40.0})
              for i in range(size)]
    # Two tokens per row lifted far above the rest: the seed picks between them.
    seeded = [SamplingParams(temperature=1.0, top_p=0.99, logit_bias={3 + i: 50.0, 1000 + 9 * i: 50.0})
              for i in range(size)]
    picks = {}
    for name, params in (("greedy", greedy), ("seeded", seeded)):
        rows = rows_of(params, seeds=range(50, 50 + size))
        picks[name] = sample(logits, rows).token_ids.tolist()
        alone = [sample(logits[i:i + 1].clone(), rows[i:i + 1]).token_ids.item() for i in range(size)]
        assert picks[name] == alone, name
    assert picks["greedy"] == [100 + 7 * i for i in range(size)]
    assert all(pick in (3 + i, 1000 + 9 * i) for i, pick in enumerate(picks["seeded"]))


def test_min_tokens_masks_the_stop_ids_of_each_row_by_its_own_count_in_a_crowd():
    size = 12
    logits = random_logits(size, seed=31)
    logits[:, EOS] = 50.0  # every row would stop now, were it allowed to
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, min_tokens=i % 5) for i in range(size)]
    positions = [(3 * i) % 7 for i in range(size)]  # both sides of each min_tokens, and on it
    rows = rows_of(params, positions=positions, seeds=range(size))
    picked = sample(logits, rows).token_ids.tolist()
    stops = [pick == EOS for pick in picked]
    assert stops == [position >= p.min_tokens for position, p in zip(positions, params, strict=True)]
    assert picked == [sample(logits[i:i + 1].clone(), rows[i:i + 1]).token_ids.item() for i in range(size)]
