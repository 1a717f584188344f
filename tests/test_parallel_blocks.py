"""Tensor parallelism on GGUF blocks (nanoserve/distributed/): N ranks give one rank's bits.

The native block kernels quantize every activation row to 8-bit blocks, so a last-bit change in
a matrix's output (a sum of the ranks' partial products, say) becomes a whole step of a code in
the next layer and grows from there: the default Q4_1 model's text left N = 1's within ten
tokens. These pin that every native block type, at N = 2, 3 and 4, decodes N = 1's greedy tokens
with N = 1's logits, first as N ranks in threads of this process (gloo over an in-process store,
one model per rank: fast), then through the engine's worker processes (few: slow on 2 cores),
and that every rank exits cleanly.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from families import Cache, step
from rank_threads import in_threads

from nanoserve import native
from nanoserve.distributed import shards
from nanoserve.distributed.collectives import Collectives
from nanoserve.distributed.shards import Shard
from nanoserve.errors import InvalidRequestError
from nanoserve.llm import LLM
from nanoserve.loading.weights import load_weights, read_config
from nanoserve.model.decoder import DecoderLM
from nanoserve.model.linear import QUANTIZED_KERNELS
from nanoserve.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[1]
BLOCK_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"]
PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):"]
DECODE_STEPS = 4

pytestmark = pytest.mark.skipif(native.library() is None, reason="the native library is off: GGUF blocks "
                                "are dequantized to float32 at load and take the float split")


@pytest.fixture
def one_thread_each():
    """One kernel thread a rank (the ranks run at once, in threads of this process)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)




def greedy_logits(model_dir: Path, gguf: Path, shard: Shard | None, group=None) -> list[torch.Tensor]:
    """Each prompt's last-row logits, then those of DECODE_STEPS greedy tokens, over the whole
    vocabulary (with a shard: its model's, the rows of every rank gathered)."""
    config, weights = load_weights(model_dir, dtype=torch.float32, device=torch.device("cpu"), gguf=gguf,
                                   shard=shard)
    collectives = None
    if shard is not None:
        start, count, _ = shard.vocab_rows(config.vocab_size)
        collectives = Collectives(group, shard, start, count, ordered=True)
    local = shards.local_config(config, shard.world if shard else 1)
    model = DecoderLM(local, weights, batch_invariant=True, linear_kernel=QUANTIZED_KERNELS["native-quant"],
                      tensor_parallel=collectives)
    cache, rows = Cache(local), []
    for seq, prompt in enumerate(PROMPTS):
        ids = [(ord(c) * 7 + seq) % config.vocab_size for c in prompt]
        chunk = (str(seq), ids, 0)
        for position in range(len(ids), len(ids) + DECODE_STEPS):
            logits = step(model, cache, [chunk])[str(seq)].unsqueeze(0)
            if collectives is not None:
                logits = collectives.all_gather(logits)
            logits = logits[0, :config.vocab_size]
            rows.append(logits)
            chunk = (str(seq), [int(logits.argmax())], position)
    return rows


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("block_type", BLOCK_TYPES)
def test_n_ranks_on_gguf_blocks_give_the_logits_of_one_bit_for_bit(wide_model_dir, wide_gguf, block_type,
                                                                   world, one_thread_each):
    gguf = wide_gguf(block_type)
    alone = greedy_logits(wide_model_dir, gguf, None)
    by_output = shards.splits_by_output(gguf, None)
    ranks = in_threads(world, lambda group, rank: greedy_logits(wide_model_dir, gguf,
                                                                Shard(rank, world, by_output), group))
    for rank_rows in ranks:
        assert len(rank_rows) == len(alone)
        for got, want in zip(rank_rows, alone, strict=True):
            assert torch.equal(got, want)


def test_blocks_split_o_and_down_by_output_and_float_weights_by_input(wide_model_dir):
    config = read_config(wide_model_dir)
    assert shards.splits_by_output("model.gguf", None) and shards.splits_by_output(None, "q8_0")
    assert not shards.splits_by_output(None, None)
    for name in ("model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        assert all(shards.tensor_split(name, config, Shard(r, 3))[0] == 1 for r in range(3))
        by_output = [shards.tensor_split(name, config, Shard(r, 3, by_output=True)) for r in range(3)]
        assert by_output == [(0, [(256 * r, 256 * (r + 1))]) for r in range(3)]


def test_a_hidden_size_the_ranks_do_not_divide_is_refused_for_blocks_naming_the_option(wide_model_dir):
    config = dataclasses.replace(read_config(wide_model_dir), hidden_size=770)
    shards.check_shardable(config, 3)  # float weights split o and down by input: no need
    with pytest.raises(InvalidRequestError, match="does not divide the model's hidden size 770") as error:
        shards.check_shardable(config, 3, by_output=True)
    assert error.value.param == "tensor_parallel_size"


# ---- through the engine's worker processes ----------------------------------------------------


LOGPROBS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)


def decode(llm: LLM) -> list[tuple[list[int], list[float]]]:
    outputs = llm.generate(PROMPTS, LOGPROBS)
    return [(out.token_ids, [entry.logprob for entry in out.logprobs]) for out in outputs]


def assert_same_decode(got, want) -> None:
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) <= 1e-4


def test_three_worker_processes_on_q4_1_decode_the_tokens_and_logprobs_of_one_and_exit_cleanly(wide_gguf):
    model = str(wide_gguf("Q4_1"))
    kernel = "native-quant-x8"  # one kernel both ways (the choice is measured per engine)
    alone = decode(LLM(model, device="cpu", threads=1, num_kv_blocks=64, linear_kernel=kernel))
    llm = LLM(model, device="cpu", threads=1, tensor_parallel_size=3, num_kv_blocks=64, linear_kernel=kernel)
    try:
        assert llm.engine.weight_format.startswith("q4_1")  # ran in its blocks, not dequantized
        assert_same_decode(decode(llm), alone)
    finally:
        llm.engine.close()
    assert [worker.process.returncode for worker in llm.engine.tp.workers] == [0, 0]


def test_generate_with_three_ranks_exits_0_with_nothing_on_stderr_but_its_own_lines(wide_gguf):
    # The heartbeat thread refreshing without pause: a worker that exits while it is inside a
    # store call aborts ("terminate called without an active exception", status -6).
    env = {**os.environ, "NANOSERVE_TP_HEARTBEAT_S": "0"}
    command = [sys.executable, "-m", "nanoserve_cli", "generate", "-m", str(wide_gguf("Q4_1")), "-tp", "3",
               "--threads", "1", "--max-tokens", "6", "The capital of France is"]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "terminate called" not in result.stderr and "Traceback" not in result.stderr
    alone = LLM(str(wide_gguf("Q4_1")), device="cpu", threads=1, num_kv_blocks=64).generate(
        ["The capital of France is"], SamplingParams(max_tokens=6, temperature=0.0))[0].text
    assert result.stdout in (alone, alone + "\n")


@pytest.mark.real_model
def test_the_default_model_at_three_ranks_decodes_the_tokens_and_logprobs_of_one(default_model_dir):
    kernel = "native-quant-x8"  # one kernel both ways (the choice is measured per engine)
    alone = decode(LLM(threads=1, linear_kernel=kernel))
    llm = LLM(threads=1, tensor_parallel_size=3, linear_kernel=kernel)
    try:
        assert llm.engine.weight_format == "q4_1+q8_0"
        assert_same_decode(decode(llm), alone)
    finally:
        llm.engine.close()
