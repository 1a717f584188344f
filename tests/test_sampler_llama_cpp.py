"""llama.cpp's samplers in the batched sampler: DRY, XTC, mirostat v1 and v2.

Each is held against a direct transcription of llama.cpp's code (ggml-org/llama.cpp,
src/llama-sampling.cpp) on fixed logits: `llama_cpp_dry_apply` transcribes
llama_sampler_dry_apply (its Z-algorithm included), `llama_cpp_xtc_apply`
llama_sample_xtc_apply, `llama_cpp_mirostat_apply` llama_sampler_mirostat_apply and
`llama_cpp_mirostat_v2_apply` llama_sampler_mirostat_v2_apply, in float32 as there. What
differs on purpose: the random numbers (llama.cpp's mt19937 stream is a keyed draw here, so
the transcriptions take the coin and the drawn token from our sampler), and where llama.cpp
keeps one of several tokens tied at a cut, all of them are kept here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from nanoserve.engine import draw as draw_module
from nanoserve.engine import sampler as sampler_module
from nanoserve.engine.sampler import BatchedSampler, RowEdits, SamplingBatch, SamplingRow
from nanoserve.errors import InvalidRequestError
from nanoserve.llm import LLM
from nanoserve.sampling_params import SamplingParams

VOCAB = 64
F32 = np.float32


def batch_of(rows: Sequence[SamplingRow], vocab: int = VOCAB) -> SamplingBatch:
    return SamplingBatch.build(rows, vocab_size=vocab, eos_token_ids=(), device="cpu")


def logits_of(seed: int, rows: int = 1, vocab: int = VOCAB, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def softmax32(logits: np.ndarray) -> np.ndarray:
    """llama_sampler_softmax_impl: exp(l - max) / sum, in float32."""
    exps = np.exp((logits - logits.max()).astype(F32)).astype(F32)
    return (exps / exps.sum(dtype=F32)).astype(F32)


# --- DRY -------------------------------------------------------------------------------------

def llama_cpp_dry_apply(last_tokens: list[int], logits: np.ndarray, *, multiplier: float, base: float,
                        allowed_length: int, penalty_last_n: int,
                        breakers: dict[int, list[list[int]]]) -> np.ndarray:
    """llama_sampler_dry_apply, line by line (rat(i) is the i-th token from the end)."""
    logits = logits.astype(F32).copy()
    def rat(i: int) -> int:
        return last_tokens[len(last_tokens) - 1 - i]
    effective_last_n = len(last_tokens) if penalty_last_n == -1 else max(penalty_last_n, 0)
    last_n_repeat = min(len(last_tokens), effective_last_n)
    if last_n_repeat <= allowed_length:
        return logits
    repeat_count = [0] * last_n_repeat
    max_token_repeat: dict[int, int] = {}
    # Step 1: restart sequences.
    rep_limit = last_n_repeat
    for i in range(last_n_repeat):
        token = rat(i)
        if token not in breakers:
            continue
        longest_match = -1
        for tail in breakers[token]:
            seq_len = len(tail)
            if (seq_len > longest_match and seq_len <= i
                    and all(tail[offset] == rat(i - offset - 1) for offset in range(seq_len))):
                longest_match = seq_len
        if longest_match >= 0:
            rep_limit = i - longest_match
            break
    if rep_limit < allowed_length:
        return logits
    # Step 2: the Z-algorithm, in reverse.
    last = last_n_repeat - 1
    rt = lt = 0
    for k in range(1, last_n_repeat):
        if k > rt:
            n = 0
            while n + k < last_n_repeat and rat(n) == rat(n + k):
                n += 1
            repeat_count[last - k] = min(n, rep_limit)
            if n > 0:
                lt, rt = k, k + n - 1
        else:
            p = k - lt
            right_part_len = rt - k + 1
            if repeat_count[last - p] < right_part_len:
                repeat_count[last - k] = min(repeat_count[last - p], rep_limit)
            else:
                i = rt + 1
                while i < last_n_repeat and rat(i) == rat(i - k):
                    i += 1
                repeat_count[last - k] = min(i - k, rep_limit)
                lt, rt = k, i - 1
    # Step 3: the longest repeat each token would extend.
    for i in range(last_n_repeat - 1):
        repeat_len = repeat_count[i]
        if repeat_len >= allowed_length:
            token = rat(last_n_repeat - 2 - i)
            if token not in max_token_repeat or max_token_repeat[token] < repeat_len:
                max_token_repeat[token] = repeat_len
    # Step 4: the penalties.
    max_exponent = 0
    if F32(base) > F32(1.000001):
        max_exponent = int(F32(88.7228391) / F32(math.log(F32(base))))
    for token, length in max_token_repeat.items():
        if [] in breakers.get(token, []):
            continue
        repeat_exp = length - allowed_length
        if max_exponent > 0 and repeat_exp > max_exponent:
            repeat_exp = max_exponent
        penalty = F32(float(F32(multiplier)) * float(F32(base)) ** repeat_exp)
        logits[token] = F32(logits[token] - penalty)
    return logits


def dry_logits(params: SamplingParams, prompt: list[int], output: list[int], logits: torch.Tensor,
               edits: RowEdits | None = None) -> torch.Tensor:
    row = SamplingRow(params, seed=0, position=len(output), prompt_ids=prompt, output_ids=output, edits=edits)
    return sampler_module._apply_edits(logits, batch_of([row]))


DRY_CASES = [  # (multiplier, base, allowed_length, penalty_last_n, breakers as (head, tail))
    (0.5, 1.75, 2, -1, ()),
    (2.0, 1.75, 1, -1, ((3, ()),)),
    (1.0, 2.0, 3, 12, ((1, ()),)),
    (0.75, 1.5, 2, 30, ((2, (0, 1)), (2, (3,)))),
    (1.0, 1.0, 2, 8, ()),
    (4.0, 3.0, 1, -1, ((0, (2,)), (5, ()))),
]


@pytest.mark.parametrize("case", DRY_CASES)
@pytest.mark.parametrize("history_seed", range(4))
def test_dry_penalised_logits_equal_llama_cpps_dry_apply(case, history_seed):
    multiplier, base, allowed, last_n, breakers = case
    rng = np.random.default_rng(history_seed)
    history = [int(t) for t in rng.integers(0, 6, size=70)]  # a small alphabet: many repeats
    params = SamplingParams(dry_multiplier=multiplier, dry_base=base, dry_allowed_length=allowed,
                            dry_penalty_last_n=last_n, dry_breaker_token_ids=breakers)
    heads: dict[int, list[list[int]]] = {}
    for head, tail in breakers:
        heads.setdefault(head, []).append(list(tail))
    logits = logits_of(history_seed, vocab=16)
    for cut in (10, 40, 69, 70):  # prompt and output split anywhere: DRY reads both
        got = dry_logits(params, history[:cut], history[cut:], logits)
        want = llama_cpp_dry_apply(history, logits[0].numpy(), multiplier=multiplier, base=base,
                                   allowed_length=allowed, penalty_last_n=last_n, breakers=heads)
        assert torch.equal(got[0], torch.from_numpy(want)), (cut, got[0] - torch.from_numpy(want))


def test_dry_comes_after_the_repetition_penalty_as_in_llama_cpps_chain():
    """llama.cpp's chain runs penalties, then dry (common/sampling.cpp, the default order)."""
    history = [1, 2, 3, 1, 2, 3, 1, 2]
    params = SamplingParams(repetition_penalty=1.5, dry_multiplier=0.5, dry_allowed_length=1)
    logits = logits_of(3, vocab=8)
    raw = logits[0].numpy()
    penalised = np.where(np.isin(np.arange(8), history),
                         np.where(raw <= 0, raw * F32(1.5), raw / F32(1.5)), raw).astype(F32)
    want = llama_cpp_dry_apply(history, penalised, multiplier=0.5, base=1.75, allowed_length=1,
                               penalty_last_n=-1, breakers={})
    assert torch.equal(dry_logits(params, history[:4], history[4:], logits)[0], torch.from_numpy(want))


def test_dry_kept_across_steps_edits_as_built_afresh_and_penalises_a_loop():
    params = SamplingParams(dry_multiplier=0.8, dry_penalty_last_n=-1, dry_breaker_token_ids=((9, ()),))
    prompt, loop = [1, 2, 3, 4], [1, 2, 3, 4, 1, 2, 3]
    edits = RowEdits(params, prompt, 16, "cpu")
    logits = torch.zeros(1, 16)
    for step in range(len(loop) + 1):
        kept = dry_logits(params, prompt, loop[:step], logits, edits)
        assert torch.equal(kept, dry_logits(params, prompt, loop[:step], logits))
    # After 1 2 3 4 1 2 3 4 1 2 3, token 4 extends a repeat of 7: 0.8 * 1.75 ** (7 - 2).
    assert kept[0, 4].item() == pytest.approx(-0.8 * 1.75**5, rel=1e-6)


def test_a_one_token_breaker_is_never_penalised_and_stops_a_repeat():
    params = SamplingParams(dry_multiplier=1.0, dry_breaker_token_ids=((0, ()),))
    penalised = dry_logits(params, [5, 6, 0, 5, 6, 0, 5, 6], [], torch.zeros(1, 8))
    assert penalised[0, 0] == 0  # 0 would extend "5 6 0 5 6" but is a breaker
    # The repeat "5 6" after the last breaker is 2 long: 5 is not next, 0 is; 7 is not a repeat.
    assert torch.count_nonzero(penalised) == 0


def test_breaker_sequences_follow_llama_cpps_overlapping_token_sequences(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), device="cpu")
    tokenizer = llm.engine.tokenizer
    text = "\n\n"
    texts = tokenizer._token_texts
    for head, tail in tokenizer.breaker_sequences(text):
        word = texts[head]
        if tail:
            overlap = next(n for n in range(len(text) - 1, 0, -1) if word.endswith(text[:n]))
            assert tokenizer.encode(text[overlap:], add_bos=False)[:20] == list(tail)
        else:
            assert text in word
    assert {h for h, t in tokenizer.breaker_sequences(text) if not t} == {
        i for i, word in enumerate(texts) if text in word}


# --- XTC -------------------------------------------------------------------------------------

def llama_cpp_xtc_apply(probs: np.ndarray, chance: float, probability: float,
                        threshold: float) -> set[int]:
    """llama_sample_xtc_apply on candidates `probs` (renormalized, nonzero ones), min_keep 0;
    the kept token ids."""
    ids = [int(i) for i in np.flatnonzero(probs)]
    if probability <= 0 or threshold > 0.5 or len(ids) < 2 or chance > probability:
        return set(ids)
    ordered = sorted(ids, key=lambda i: -probs[i])
    pos_last = 0
    for i, token in enumerate(ordered):
        if probs[token] >= F32(threshold):
            pos_last = i
        else:
            break
    return set(ordered[pos_last:]) if pos_last > 0 else set(ids)


def kept_ids(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[set[int]]:
    kept = draw_module.kept_mass(logits, batch_of(rows, logits.shape[-1]).draw)
    return [set(torch.nonzero(row).flatten().tolist()) for row in kept]


def xtc_coin(seed: int, position: int) -> float:
    seed_t, position_t = torch.tensor([seed]), torch.tensor([position])
    return float(draw_module.uniform_from_counter(draw_module._mix64(seed_t ^ draw_module._XTC_KEY),
                                                  position_t)[0])


@pytest.mark.parametrize("filters", [{}, {"top_k": 8}, {"min_p": 0.02}, {"top_p": 0.9}])
@pytest.mark.parametrize("threshold", [0.05, 0.1, 0.2])
def test_xtc_kept_set_equals_llama_cpps_xtc_apply_after_the_other_filters(filters, threshold):
    for seed in range(6):
        logits = logits_of(seed)
        before = SamplingParams(**filters)
        with_xtc = SamplingParams(**filters, xtc_probability=0.5, xtc_threshold=threshold)
        for position in range(4):
            survivors = kept_ids(logits, [SamplingRow(before, seed, position, (), ())])[0]
            # The shares XTC reads: the softmax over what the filters before it kept.
            masked = np.full(VOCAB, -np.inf, dtype=F32)
            masked[list(survivors)] = logits[0].numpy()[list(survivors)]
            want = llama_cpp_xtc_apply(softmax32(masked), xtc_coin(seed, position), 0.5, threshold)
            assert kept_ids(logits, [SamplingRow(with_xtc, seed, position, (), ())])[0] == want


def test_xtc_coin_is_a_keyed_draw_of_its_own_falling_at_its_probability():
    coins = [xtc_coin(7, position) for position in range(4000)]
    assert sum(c <= 0.3 for c in coins) / len(coins) == pytest.approx(0.3, abs=0.03)
    token_uniforms = draw_module.uniform_from_counter(torch.full((4000,), 7), torch.arange(4000))
    assert not np.allclose(coins, token_uniforms.numpy())


# --- mirostat --------------------------------------------------------------------------------

def llama_cpp_mirostat_v2_apply(logits: np.ndarray, mu: float) -> set[int]:
    """llama_sampler_mirostat_v2_apply's kept set (temperature 1: the chain's temp is a no-op)."""
    probs = softmax32(logits)
    ordered = np.argsort(-probs, kind="stable")
    kept = [int(t) for t in ordered if not -np.log2(probs[t]) > F32(mu)]
    return set(kept or [int(ordered[0])])


def llama_cpp_mirostat_apply(logits: np.ndarray, mu: float, m: int = 100) -> set[int]:
    """llama_sampler_mirostat_apply's kept set: s_hat, then k, then top_k."""
    probs = softmax32(logits)
    ordered = np.argsort(-probs, kind="stable")
    p = probs[ordered]
    sum_ti_bi = sum_ti_sq = F32(0)
    for i in range(min(m - 1, len(p) - 1)):
        t_i = F32(math.log((i + 2) / (i + 1)))
        b_i = F32(np.log(p[i] / p[i + 1]))
        sum_ti_bi, sum_ti_sq = F32(sum_ti_bi + t_i * b_i), F32(sum_ti_sq + t_i * t_i)
    s_hat = F32(sum_ti_bi / sum_ti_sq)
    epsilon_hat = F32(s_hat - 1)
    k = F32((epsilon_hat * F32(2) ** F32(mu)) / (1 - F32(len(p)) ** -epsilon_hat)) ** F32(1 / s_hat)
    return {int(t) for t in ordered[:max(int(k), 1)]}


def llama_cpp_mu_update(mu: float, probs_kept: np.ndarray, token: int, tau: float, eta: float) -> float:
    observed_surprise = F32(-np.log2(probs_kept[token]))
    return float(F32(F32(mu) - F32(eta) * F32(observed_surprise - F32(tau))))


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("tau,eta", [(5.0, 0.1), (3.0, 0.5), (1.0, 0.3)])
def test_mirostat_kept_sets_and_mu_follow_llama_cpp_step_by_step(version, tau, eta):
    vocab = 512
    params = SamplingParams(temperature=1.0, mirostat=version, mirostat_tau=tau, mirostat_eta=eta, seed=3)
    edits = RowEdits(params, (1, 2), vocab, "cpu")
    mu = float(F32(2 * tau))
    transcription = llama_cpp_mirostat_apply if version == 1 else llama_cpp_mirostat_v2_apply
    for position in range(12):
        logits = logits_of(100 + position, vocab=vocab, scale=2.0 + position % 3)
        row = SamplingRow(params, 3, position, (1, 2), [0] * position, edits)
        want = transcription(logits[0].numpy(), mu)
        assert kept_ids(logits, [row])[0] == want, position
        token = int(BatchedSampler()(logits, batch_of([row], vocab)).token_ids[0])
        assert token in want
        masked = np.full(vocab, -np.inf, dtype=F32)
        masked[list(want)] = logits[0].numpy()[list(want)]
        mu = llama_cpp_mu_update(mu, softmax32(masked), token, tau, eta)
        assert float(edits.mirostat.at(position + 1)) == pytest.approx(mu, abs=2e-5)


def test_mirostat_cuts_the_distribution_the_logit_edits_and_temperature_left():
    """llama.cpp's mirostat chain: logit_bias, temp, then mirostat (common/sampling.cpp)."""
    bias = {3: 4.0, 7: -3.0}
    params = SamplingParams(temperature=0.7, mirostat=2, mirostat_tau=2.5, logit_bias=bias)
    logits = logits_of(21)
    edited = logits[0].numpy().copy()
    for token, amount in bias.items():
        edited[token] = F32(edited[token] + F32(amount))
    row = SamplingRow(params, 1, 0, (), (), RowEdits(params, (), VOCAB, "cpu"))
    assert kept_ids(sampler_module._apply_edits(logits, batch_of([row])), [row])[0] == \
        llama_cpp_mirostat_v2_apply((edited / F32(0.7)).astype(F32), float(F32(2 * 2.5)))


def test_mirostat_mu_is_read_per_position_so_a_redrawn_position_draws_the_same():
    params = SamplingParams(mirostat=2, mirostat_tau=2.0, seed=11)
    edits = RowEdits(params, (), VOCAB, "cpu")
    picks = []
    for position in (0, 1, 1, 2, 2, 3):  # positions 1 and 2 drawn twice
        logits = logits_of(position)
        row = SamplingRow(params, 11, position, (), [0] * position, edits)
        picks.append((position, int(BatchedSampler()(logits, batch_of([row])).token_ids[0]),
                      float(edits.mirostat.at(position + 1))))
    assert picks[1] == picks[2] and picks[3] == picks[4]
    assert picks[4] != picks[5]


# --- crowds, order, validation ---------------------------------------------------------------

LLAMA_CPP_ROWS = [
    SamplingParams(temperature=0.9, dry_multiplier=0.8, dry_breaker_token_ids=((5, ()),)),
    SamplingParams(temperature=1.1, xtc_probability=0.7, xtc_threshold=0.05, top_k=20),
    SamplingParams(temperature=0.8, mirostat=1, mirostat_tau=4.0),
    SamplingParams(temperature=1.3, mirostat=2, mirostat_tau=3.0, mirostat_eta=0.2),
    SamplingParams(temperature=1.0, top_p=0.9, repetition_penalty=1.2),
    SamplingParams(temperature=0.0, dry_multiplier=1.0),
]


def run_steps(params: Sequence[SamplingParams], order: Sequence[int], steps: int = 6) -> dict[int, list]:
    """Each row's tokens and mirostat mu over `steps` steps, the rows in a batch in `order`."""
    histories = {i: [] for i in order}
    edits = {i: RowEdits(params[i], (1, 2, 3), 256, "cpu") for i in order}
    for step in range(steps):
        rows = [SamplingRow(params[i], 40 + i, step, (1, 2, 3), [t for t, _ in histories[i]], edits[i])
                for i in order]
        logits = torch.stack([logits_of(1000 * i + step, vocab=256)[0] for i in order])
        tokens = BatchedSampler()(logits, batch_of(rows, 256)).token_ids
        for row_index, i in enumerate(order):
            mu = edits[i].mirostat.at(step + 1) if edits[i].mirostat is not None else None
            histories[i].append((int(tokens[row_index]), None if mu is None else mu.clone()))
    return histories


def test_each_llama_cpp_sampler_row_draws_bit_identically_alone_and_in_a_crowd():
    crowd = run_steps(LLAMA_CPP_ROWS, [5, 2, 0, 4, 3, 1])
    for i in range(len(LLAMA_CPP_ROWS)):
        alone = run_steps(LLAMA_CPP_ROWS, [i])[i]
        for (token, mu), (crowd_token, crowd_mu) in zip(alone, crowd[i], strict=True):
            assert token == crowd_token
            assert mu is None or torch.equal(mu.view(torch.int32), crowd_mu.view(torch.int32))


def test_llama_cpps_samplers_read_nothing_back_to_the_host(monkeypatch):
    edits = [RowEdits(p, (1, 2, 3), 256, "cpu") for p in LLAMA_CPP_ROWS]
    rows = [SamplingRow(p, 9, 0, (1, 2, 3), [], e) for p, e in zip(LLAMA_CPP_ROWS, edits, strict=True)]
    batch = batch_of(rows, 256)  # DRY's history is numpy on the host: built before the sampler runs

    def readback(*_args, **_kwargs):
        raise AssertionError("the sampler read a tensor back to the host")

    for name in ("tolist", "item", "__int__", "__bool__", "__index__", "__float__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, readback)
    monkeypatch.setattr(torch, "nonzero", readback)
    out = BatchedSampler()(logits_of(5, len(rows), 256), batch)
    monkeypatch.undo()
    assert out.token_ids.shape == (len(rows),)


def test_mirostat_replaces_the_truncation_samplers_and_refuses_them_by_name():
    for name, value in [("top_k", 40), ("top_p", 0.9), ("min_p", 0.1), ("typical_p", 0.5),
                        ("top_n_sigma", 1.0), ("p_less", True), ("xtc_probability", 0.5)]:
        with pytest.raises(InvalidRequestError) as err:
            SamplingParams(mirostat=2, **{name: value})
        assert err.value.param == name and "mirostat" in str(err.value)


@pytest.mark.parametrize("field,value", [
    ("dry_multiplier", -1.0), ("dry_base", 0.5), ("dry_allowed_length", 0), ("dry_penalty_last_n", -2),
    ("dry_sequence_breakers", [""]), ("dry_sequence_breakers", ["x" * 41]), ("xtc_probability", 1.5),
    ("xtc_threshold", -0.1), ("mirostat", 3), ("mirostat", True), ("mirostat_tau", float("nan")),
    ("mirostat_eta", -0.1),
])
def test_a_bad_llama_cpp_sampler_value_is_refused_naming_its_field(field, value):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field


def test_llama_server_defaults_leave_every_row_as_it_was():
    params = SamplingParams(temperature=1.0, seed=1)
    assert not (params.dry_active or params.xtc_active or params.mirostat)
    assert (params.dry_base, params.dry_allowed_length, params.dry_penalty_last_n, params.xtc_threshold,
            params.mirostat_tau, params.mirostat_eta) == (1.75, 2, -1, 0.1, 5.0, 0.1)
    assert params.dry_sequence_breakers == ("\n", ":", "\"", "*")


def test_preemption_by_recompute_changes_no_token_of_a_dry_xtc_or_mirostat_request(tiny_model_dir):
    prompts = [f"request {i}:" + " hi" * i for i in range(6)]
    kinds = [dict(dry_multiplier=1.5, dry_allowed_length=1), dict(xtc_probability=0.8, xtc_threshold=0.01),
             dict(mirostat=1, mirostat_tau=3.0), dict(mirostat=2, mirostat_tau=2.0, mirostat_eta=0.5)]
    params = [SamplingParams(max_tokens=16, temperature=1.0, seed=i, ignore_eos=True, **kinds[i % 4])
              for i in range(6)]
    roomy = LLM(str(tiny_model_dir), device="cpu", batch_invariant=True)
    cramped = LLM(str(tiny_model_dir), device="cpu", batch_invariant=True, num_kv_blocks=14, block_size=4)
    expected = [c.token_ids for c in roomy.generate(prompts, params)]
    alone = [roomy.generate([p], [q])[0].token_ids for p, q in zip(prompts, params, strict=True)]
    got = [c.token_ids for c in cramped.generate(prompts, params)]
    assert cramped.engine.scheduler.num_preemptions >= 3, "the pool was not small enough to preempt"
    assert got == expected == alone
    assert cramped.engine.pool.is_completely_free
