"""Sliding-window KV release (SchedulerConfig.kv_window): a model whose every layer slides gives
back the blocks wholly before its window as a request advances.

Properties: the scheduler never releases a block a planned chunk's queries can see (with
prefix caching, preemption and aborts in the mix, and with a step launched ahead of the
previous one's resolution); the pool's counts stay right and return to free; through the
engine, greedy tokens of a Mistral-style checkpoint equal transformers' and are bit-identical
(tokens and logprobs) with and without the release, while it holds fewer blocks at its peak;
a mixed model (full layers beside sliding ones) keeps every block.
"""

import shutil

import families
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.config import ModelConfig, SchedulerConfig
from nanoserve.engine.block_pool import BlockPool
from nanoserve.engine.request import Request, RequestStatus
from nanoserve.engine.scheduler import NewToken, Scheduler
from nanoserve.errors import InvalidRequestError
from nanoserve.loading.hf_config import read_model_config
from nanoserve.sampling_params import SamplingParams

BLOCK = 4


def first_visible_block(position: int, window: int) -> int:
    """The first block a query at `position` reads: it sees keys after position - window."""
    return max(0, position - window + 1) // BLOCK


def check_pool(scheduler: Scheduler, num_blocks: int) -> None:
    held = [b for r in scheduler.running for b in r.block_ids[r.num_released_blocks:]]
    scheduler.pool.check()
    assert all(scheduler.pool.ref_count(b) == held.count(b) for b in held), "reference counts off"
    assert scheduler.pool.num_free_blocks == num_blocks - len(set(held))
    assert all(not r.block_ids and not r.num_released_blocks for r in scheduler.waiting)


def tokens_for(plan) -> list[NewToken]:
    """A model that always samples 7 and stops only at max_tokens (a request finished since
    the plan was launched yields nothing: the engine drops that overshoot row)."""
    new = []
    for chunk in plan.chunks:
        if chunk.samples and not chunk.request.status.is_finished:
            last = len(chunk.request.output_ids) + 1 >= chunk.request.params.max_tokens
            new.append(NewToken(chunk.request.request_id, 7, RequestStatus.FINISHED_LENGTH if last else None))
    return new


def check_visible_blocks_held(plan, window: int) -> None:
    for chunk in plan.chunks:
        assert chunk.request.num_released_blocks <= first_visible_block(chunk.start, window), (
            f"{chunk.request.request_id}: a block its chunk at {chunk.start} reads went back to the pool")


@settings(max_examples=120, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["add", "step", "step", "step", "abort"]),
                       st.integers(1, 30), st.integers(1, 24)), max_size=80),
    st.integers(8, 40),
    st.sampled_from([1, 3, 5, 8, 13]),
    st.booleans(),
    st.booleans(),
)
def test_released_blocks_are_never_read_and_the_pool_stays_right(ops, num_blocks, window, prefix_caching,
                                                                 deferred):
    """`deferred`: each step is launched (committed) before the previous one is resolved, as the
    engine's deferred output does, so a release must spare what the step in flight reads."""
    pool = BlockPool(num_blocks, BLOCK)
    scheduler = Scheduler(SchedulerConfig(4, 24, 256, enable_prefix_caching=prefix_caching,
                                          kv_window=window), pool)
    in_flight = None
    live = []
    for i, (op, size, max_tokens) in enumerate(ops):
        if op == "add":
            try:
                scheduler.check_fits(size, max_tokens)
            except InvalidRequestError:
                continue
            # prompts share their first tokens, so prefix caching finds released blocks again
            request = Request(str(i), [1, 2, 3, 4, 5, 6, 7, 8][:size] + list(range(9, size + 1)),
                              SamplingParams(max_tokens=max_tokens, temperature=0.0), seed=0)
            scheduler.add(request)
            live.append(request)
        elif op == "abort" and live and in_flight is None:
            request = live.pop(size % len(live))
            if not request.status.is_finished:
                scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        elif op == "step":
            plan = scheduler.schedule()
            check_visible_blocks_held(plan, window)
            if deferred and in_flight is None and not plan.is_empty:
                scheduler.commit(plan)
                in_flight = plan
                continue
            if deferred and in_flight is not None:
                scheduler.commit(plan)
                scheduler.update_after_step(in_flight, tokens_for(in_flight))
                check_visible_blocks_held(plan, window)  # the step now in flight still reads its blocks
                in_flight = plan
            else:
                scheduler.update_after_step(plan, tokens_for(plan))
        if in_flight is None:
            check_pool(scheduler, num_blocks)
    if in_flight is not None:
        scheduler.update_after_step(in_flight, tokens_for(in_flight))
    for _ in range(2000):
        if not scheduler.has_unfinished():
            break
        plan = scheduler.schedule()
        check_visible_blocks_held(plan, window)
        scheduler.update_after_step(plan, tokens_for(plan))
    assert not scheduler.has_unfinished(), "some request never finished"
    assert pool.is_completely_free


def test_a_long_decode_holds_only_the_blocks_its_window_reaches():
    pool = BlockPool(64, BLOCK)
    scheduler = Scheduler(SchedulerConfig(4, 64, 256, kv_window=6), pool)
    scheduler.add(Request("a", list(range(1, 31)), SamplingParams(max_tokens=60, temperature=0.0), seed=0))
    peak = 0
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        peak = max(peak, pool.num_blocks - pool.num_free_blocks)
        scheduler.update_after_step(plan, tokens_for(plan))
    # 30 prompt tokens in one step (8 blocks), then the window's 6 keys span at most 3 blocks
    # and the next one grows: never the 23 blocks of 90 positions.
    assert peak == 8
    assert pool.is_completely_free


def test_mixed_models_keep_every_block_and_all_sliding_ones_release():
    mistral = families.BASE | {"model_type": "mistral", "architectures": ["MistralForCausalLM"],
                               "sliding_window": 5}
    assert read_model_config(mistral).kv_window == 5
    gemma2 = families.BASE | {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"],
                              "sliding_window": 5, "head_dim": 16}
    assert read_model_config(gemma2).kv_window == 0  # every other layer sees everything
    qwen2 = families.BASE | {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                             "sliding_window": 5, "use_sliding_window": True, "max_window_layers": 0}
    assert read_model_config(qwen2).kv_window == 5


families.require_transformers()
MISTRAL = families.Case("mistral-window-5", "MistralConfig",
                        {"sliding_window": 5, "head_dim": 16, "vocab_size": 400})  # the tokenizer's 384 fit
PROMPTS = [[5, 17, 33, 8, 91, 4, 60, 3, 9, 11, 12], [3, *range(40, 60)]]


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory, tiny_model_dir):
    path = tmp_path_factory.mktemp("mistral")
    model = families.write_checkpoint(MISTRAL, path)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / file, path / file)
    return path, [families.reference_greedy(model, p, 40) for p in PROMPTS]


def generate(path, monkeypatch, *, release: bool, num_kv_blocks: int = 64, repeat: int = 1):
    """Each prompt's (token ids, logprobs) through LLM, `repeat` times on one LLM (every time
    the same), and the pool's peak of held blocks, preemptions and prefix-cache hits."""
    from nanoserve.llm import LLM

    if not release:
        monkeypatch.setattr(ModelConfig, "kv_window", property(lambda self: 0))
    # No prefill pace: the peaks below count the two prompts prefilling together in one step.
    llm = LLM(str(path), device="cpu", num_kv_blocks=num_kv_blocks, block_size=BLOCK, max_num_seqs=4,
              prefill_step_ms=float("inf"))
    pool, peak = llm.engine.pool, [0]
    allocate = pool.allocate

    def counting(num_blocks):
        out = allocate(num_blocks)
        peak[0] = max(peak[0], pool.num_blocks - pool.num_free_blocks)
        return out

    pool.allocate = counting
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    runs = []
    for _ in range(repeat):
        results = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        assert pool.is_completely_free
        runs.append([(r.outputs[0].token_ids, r.outputs[0].logprobs) for r in results])
    monkeypatch.undo()
    assert all(run == runs[0] for run in runs)
    scheduler = llm.engine.scheduler
    return runs[0], (peak[0], scheduler.num_preemptions, scheduler.prefix_cache_hits)


def test_released_windows_change_no_token_or_logprob_and_hold_fewer_blocks(mistral_dir, monkeypatch):
    path, expected = mistral_dir
    released, (released_peak, _, _) = generate(path, monkeypatch, release=True)
    kept, (kept_peak, _, _) = generate(path, monkeypatch, release=False)
    assert [tokens for tokens, _ in released] == expected
    assert released == kept
    # Kept: every computed position, 11 + 39 and 21 + 39 (the last token is never fed back),
    # 13 + 15 blocks. Released: the peak is the two prompts' own blocks (3 + 6) as they
    # prefill together; after that each holds the window's 2 blocks and the one growing.
    assert (kept_peak, released_peak) == (13 + 15, 3 + 6)


def test_under_preemption_tokens_stay_transformers(mistral_dir, monkeypatch):
    """A pool of 16 blocks, too small for both requests' whole contexts (28): without the
    release they preempt each other and recompute, with it they fit."""
    path, expected = mistral_dir
    released, (_, preempted, _) = generate(path, monkeypatch, release=True, num_kv_blocks=16)
    assert [tokens for tokens, _ in released] == expected and preempted == 0
    kept, (_, preempted, _) = generate(path, monkeypatch, release=False, num_kv_blocks=16)
    assert kept == released and preempted > 0


def test_released_blocks_stay_in_the_prefix_cache_for_the_next_request(mistral_dir, monkeypatch):
    """The second generate on one LLM finds the prompts' released blocks cached."""
    path, expected = mistral_dir
    released, (_, _, hits) = generate(path, monkeypatch, release=True, repeat=2)
    assert [tokens for tokens, _ in released] == expected
    assert hits == (len(PROMPTS[0]) - 1) // BLOCK * BLOCK + (len(PROMPTS[1]) - 1) // BLOCK * BLOCK
