"""Tensor parallelism (nanoserve/distributed/): the shard arithmetic, the step message, the
rank-ordered all-reduce, N ranks against one (tokens, logits, a crowd's bits), quantized and
GGUF weights split, the memory each rank holds, and the faults: bad sizes, a port in use, an
unreachable master, a worker killed mid-generation, a two-node torchrun launch on loopback.

Engines with N > 1 start real worker processes (gloo on the CPU), so they are few and shared
per module; every N = 4 engine runs one thread a rank.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from rank_threads import gloo, in_threads
from test_batch_invariance import crowd_prompts, fingerprint, params_for, staggered_crowd
from test_engine import readbacks_raise_outside_the_output_processor
from tiny_model import write_tiny_gguf
from typer.testing import CliRunner

from nanoserve import quant
from nanoserve.distributed import group as tp_group
from nanoserve.distributed import shards
from nanoserve.distributed.collectives import Collectives
from nanoserve.distributed.group import TensorParallelError
from nanoserve.distributed.shards import Shard
from nanoserve.errors import InvalidRequestError
from nanoserve.llm import LLM
from nanoserve.loading.hf_names import hf_tensor_shapes
from nanoserve.loading.weights import load_weights, read_config
from nanoserve.model.batch import AttentionGroup, ForwardBatch
from nanoserve.sampling_params import SamplingParams
from nanoserve_cli.main import app

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
           "Hello! How are you today?", "1, 2, 3, 4, 5,"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
REPO = Path(__file__).resolve().parents[1]


def tiny_llm(model: str, n: int, **options) -> LLM:
    threads = {"threads": 1} if n > 2 else {}
    return LLM(model, device="cpu", tensor_parallel_size=n, num_kv_blocks=96, max_num_seqs=16,
               **threads, **options)


def tokens(llm: LLM) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def solo(tiny_model_dir):
    llm = tiny_llm(str(tiny_model_dir), 1)
    return tokens(llm), llm.engine.prompt_logits(PROMPTS), llm


@pytest.fixture(scope="module")
def two(tiny_model_dir):
    llm = tiny_llm(str(tiny_model_dir), 2)
    yield llm
    llm.engine.close()


# ---- shard arithmetic ------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
def test_every_split_tensor_is_covered_once_by_the_ranks_and_each_rank_reads_its_own_kv_head(
        tiny_model_dir, world):
    config = read_config(tiny_model_dir)
    for name, shape in hf_tensor_shapes(config).items():
        splits = [shards.tensor_split(name, config, Shard(r, world)) for r in range(world)]
        if splits[0] is None:
            continue
        dim = splits[0][0]
        covered = sorted(span for _, ranges in splits for span in ranges)
        kind = name.split(".")[-2]
        if kind in ("k_proj", "v_proj") and config.num_kv_heads % world:
            # Replicated: rank r holds the K/V head its query heads (r*H/N ...) read.
            per_kv = config.num_heads // config.num_kv_heads
            for r, (_, [(start, _stop)]) in enumerate(splits):
                assert start // config.head_dim == r * config.num_heads // world // per_kv
            continue
        assert covered[0][0] == 0 and covered[-1][1] == shape[dim]
        assert all(a[1] == b[0] for a, b in itertools.pairwise(covered))


def test_a_head_count_the_size_does_not_divide_is_refused_naming_the_option(tiny_model_dir):
    config = read_config(tiny_model_dir)
    with pytest.raises(InvalidRequestError, match="3 does not divide the model's 4 attention heads") as error:
        shards.check_shardable(config, 3)
    assert error.value.param == "tensor_parallel_size"


def test_gguf_blocks_split_by_rows_and_by_whole_blocks_of_columns_only():
    dense = torch.randn(8, 128)
    blocks = quant.quantize(dense, "q8_0")
    rows = shards.take(blocks, 0, [(2, 5)])
    assert torch.equal(rows.dequantize(), blocks.dequantize()[2:5])
    cols = shards.take(blocks, 1, [(32, 96)])
    assert torch.equal(cols.dequantize(), blocks.dequantize()[:, 32:96])
    with pytest.raises(InvalidRequestError, match="not whole blocks") as error:
        shards.take(blocks, 1, [(16, 48)])
    assert error.value.param == "tensor_parallel_size"


def test_the_step_message_carries_a_batch_exactly():
    groups = [AttentionGroup(0, 2, 1, torch.tensor([[5], [9]]), torch.tensor([[1, 0], [2, 3]]), (5, 9)),
              AttentionGroup(2, 1, 3, torch.tensor([[0, 1, 2]]), torch.tensor([[4]]), None)]
    batch = ForwardBatch(torch.tensor([7, 8, 1, 2, 3]), torch.tensor([5, 9, 0, 1, 2]),
                         torch.tensor([21, 57, 64, 65, 66]), groups, torch.tensor([0, 1, 4]))
    back = tp_group.decode_batch(tp_group.encode_batch(batch), torch.device("cpu"))
    for field in ("input_ids", "positions", "slot_mapping", "logits_rows"):
        assert torch.equal(getattr(back, field), getattr(batch, field))
    for got, want in zip(back.groups, batch.groups, strict=True):
        assert (got.row_start, got.num_seqs, got.rows_per_seq, got.first_positions) == (
            want.row_start, want.num_seqs, want.rows_per_seq, want.first_positions)
        assert torch.equal(got.positions, want.positions) and torch.equal(got.block_tables, want.block_tables)




@pytest.mark.parametrize("rows", [1, 7, 300])
def test_the_batch_invariant_all_reduce_sums_the_ranks_in_rank_order_on_every_rank(rows):
    world = 4
    parts = [torch.randn(rows, 1000, generator=torch.Generator().manual_seed(r)) * 10 ** r
             for r in range(world)]
    in_order = ((parts[0] + parts[1]) + parts[2]) + parts[3]

    def work(group, rank):
        return Collectives(group, Shard(rank, world), 0, 1, ordered=True).all_reduce(parts[rank].clone())

    for result in in_threads(world, work, gloo(20.0)):
        assert torch.equal(result, in_order)


def test_the_vocabulary_parallel_embedding_is_exact():
    world, table = 2, torch.randn(10, 4)
    table[3] = -0.0  # a row of negative zeros keeps its sign
    ids = torch.tensor([0, 3, 4, 5, 9])

    def work(group, rank):
        shard = Shard(rank, world)
        start, count, _ = shard.vocab_rows(10)
        collectives = Collectives(group, shard, start, count, ordered=True)
        return collectives.embedding(ids, table[start:start + count])

    for rows in in_threads(world, work, gloo(20.0)):
        assert torch.equal(rows, table[ids]) and torch.equal(rows.signbit(), table[ids].signbit())


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_holds_a_1_over_n_share_of_the_weights_plus_the_replicated_parts(tiny_model_dir, world):
    config, whole = load_weights(tiny_model_dir, dtype=torch.float32, device=torch.device("cpu"))
    norms = whole.norm.nbytes + sum(w.input_norm.nbytes + w.post_norm.nbytes for w in whole.layers)
    kv_bytes = 2 * config.num_kv_heads * config.head_dim * config.hidden_size * 4 * config.num_layers
    replicated_kv = kv_bytes // min(world, config.num_kv_heads) if config.num_kv_heads % world else 0
    split = whole.nbytes() - norms - (kv_bytes if replicated_kv else 0)
    for rank in range(world):
        _, shard = load_weights(tiny_model_dir, dtype=torch.float32, device=torch.device("cpu"),
                                shard=Shard(rank, world))
        assert shard.nbytes() <= split / world + norms + replicated_kv


# ---- N ranks against one ---------------------------------------------------------------------


def test_two_ranks_decode_the_tokens_of_one_and_their_logits_lie_within_1e_5(solo, two):
    solo_tokens, solo_logits, _ = solo
    assert tokens(two) == solo_tokens
    assert (two.engine.prompt_logits(PROMPTS) - solo_logits).abs().max() <= 1e-5


def test_four_ranks_with_replicated_kv_heads_decode_the_tokens_of_one(solo, tiny_model_dir):
    solo_tokens, solo_logits, _ = solo
    llm = tiny_llm(str(tiny_model_dir), 4)
    try:
        assert llm.engine.model.config.num_kv_heads == 1  # 2 K/V heads over 4 ranks: replicated
        assert tokens(llm) == solo_tokens
        assert (llm.engine.prompt_logits(PROMPTS) - solo_logits).abs().max() <= 1e-5
        prompts, params = crowd_prompts(6), [params_for(i, max_tokens=6) for i in range(6)]
        alone = [fingerprint(llm.generate([p], [sp])[0]) for p, sp in zip(prompts, params, strict=True)]
        assert staggered_crowd(llm, prompts, params) == alone
    finally:
        llm.engine.close()


def test_with_two_ranks_a_seeded_crowd_gets_every_request_its_solo_tokens_and_logprobs(two):
    prompts, params = crowd_prompts(10), [params_for(i, max_tokens=8) for i in range(10)]
    alone = [fingerprint(two.generate([p], [sp])[0]) for p, sp in zip(prompts, params, strict=True)]
    assert staggered_crowd(two, prompts, params) == alone


def test_with_two_ranks_a_decode_step_still_reads_back_once(two):
    engine = two.engine
    engine.add_request("The capital of France is", SamplingParams(max_tokens=4, temperature=0.0))
    steps = 0
    with readbacks_raise_outside_the_output_processor() as reads:
        while engine.has_unfinished():
            engine.step()
            steps += 1
    assert len(reads) == steps


def test_the_plain_all_reduce_without_batch_invariance_gives_logits_within_1e_5(solo, tiny_model_dir):
    _, solo_logits, _ = solo
    llm = tiny_llm(str(tiny_model_dir), 2, batch_invariant=False)
    try:
        assert not llm.engine.tp.collectives.ordered
        assert (llm.engine.prompt_logits(PROMPTS) - solo_logits).abs().max() <= 1e-5
    finally:
        llm.engine.close()


@pytest.mark.parametrize("source", ["quantize", "gguf"])
def test_quantized_weights_split_over_two_ranks_decode_the_tokens_of_one(tiny_model_dir, tmp_path, source):
    if source == "gguf":
        model = str(write_tiny_gguf(tmp_path / "tiny-q8_0.gguf", tiny_model_dir,
                                    matrix_type=GGMLQuantizationType.Q8_0))
        options = {}
    else:
        model, options = str(tiny_model_dir), {"quantize": "q8_0"}
    one = tiny_llm(model, 1, **options)
    expected, logits = tokens(one), one.engine.prompt_logits(PROMPTS)
    llm = tiny_llm(model, 2, **options)
    try:
        assert llm.engine.model.weights.is_quantized() == one.engine.model.weights.is_quantized()
        assert tokens(llm) == expected
        assert (llm.engine.prompt_logits(PROMPTS) - logits).abs().max() <= 1e-4
    finally:
        llm.engine.close()


# ---- bad input and faults ---------------------------------------------------------------------


@pytest.mark.parametrize("command", ["generate", "serve", "bench", "profile"])
@pytest.mark.parametrize("size", ["0", "-2"])
def test_a_tensor_parallel_size_below_one_exits_2_naming_the_option(command, size):
    prompt = ["Hi"] if command == "generate" else []
    result = CliRunner().invoke(app, [command, "--tensor-parallel-size", size, *prompt])
    assert result.exit_code == 2 and "tensor-parallel-size" in result.output


def test_a_size_that_does_not_divide_the_heads_exits_2_naming_the_option_before_any_worker(
        tiny_model_dir, monkeypatch):
    monkeypatch.setattr(tp_group, "_spawn", lambda *args: pytest.fail("a worker started"))
    result = CliRunner().invoke(app, ["generate", "-m", str(tiny_model_dir), "-tp", "3", "Hi"])
    assert result.exit_code == 2 and "--tensor-parallel-size" in result.output
    assert "does not divide the model's 4 attention heads" in result.output


@pytest.mark.parametrize("size", [0, -1])
def test_llm_refuses_a_size_below_one_with_a_value_error_naming_the_field(size):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(tensor_parallel_size=size)


def test_more_ranks_than_cores_and_a_port_in_use_are_refused_before_any_worker_starts(
        tiny_model_dir, monkeypatch):
    def no_spawn(*args):
        raise AssertionError("a worker started")

    monkeypatch.setattr(tp_group, "_spawn", no_spawn)
    monkeypatch.setattr(tp_group, "cores", lambda: 2)
    with pytest.raises(InvalidRequestError, match="more ranks than this machine's 2 cores"):
        LLM(str(tiny_model_dir), device="cpu", tensor_parallel_size=4)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setenv("MASTER_PORT", str(taken.getsockname()[1]))
        with pytest.raises(InvalidRequestError, match=r"MASTER_PORT .* is not free") as error:
            LLM(str(tiny_model_dir), device="cpu", tensor_parallel_size=2)
    assert error.value.param == "tensor_parallel_size"


def test_a_rank_that_cannot_reach_the_master_gives_up_within_its_timeout(monkeypatch):
    monkeypatch.setattr(tp_group, "CONNECT_TIMEOUT_S", 2.0)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again below: nobody listens there
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank 1 could not reach the group at 127\.0\.0\.1"):
        tp_group.join(1, 2, "127.0.0.1", port, torch.device("cpu"))
    assert time.monotonic() - start < 15


FAULTY_WORKER_SCRIPT = textwrap.dedent("""
    import sys
    from nanoserve import LLM, SamplingParams
    llm = LLM(sys.argv[1], device="cpu", tensor_parallel_size=2, num_kv_blocks=64)
    print("worker", llm.engine.tp.workers[0].process.pid, flush=True)
    while True:
        llm.generate(["Hello"], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
        print("generated", flush=True)
""")


@pytest.mark.parametrize(("fault", "signal_number"), [("killed", signal.SIGKILL), ("hung", signal.SIGSTOP)])
def test_a_worker_killed_or_hung_mid_generation_ends_the_engine_naming_its_rank_within_30_s(
        tiny_model_dir, fault, signal_number):
    # A hung rank is found by the step's collective timing out: 5 s here, 30 s by default.
    env = {**os.environ, "NANOSERVE_TP_TIMEOUT_S": "5"}
    engine = subprocess.Popen([sys.executable, "-c", FAULTY_WORKER_SCRIPT, str(tiny_model_dir)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    worker_pid = None
    try:
        worker_pid = int(engine.stdout.readline().split()[1])
        assert engine.stdout.readline().strip() == "generated"  # generating now, again
        os.kill(worker_pid, signal_number)
        struck = time.monotonic()
        status = engine.wait(timeout=30)
        assert time.monotonic() - struck < 30
    finally:
        if engine.poll() is None:
            engine.kill()
        if worker_pid is not None and fault == "hung":
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker_pid, signal.SIGKILL)
    assert status != 0
    assert "rank 1" in engine.stderr.read()


@pytest.mark.skipif(shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None,
                    reason="torchrun is not installed beside this python")
def test_a_two_node_torchrun_launch_on_loopback_decodes_the_text_of_one_process(solo, tiny_model_dir):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    # Both "nodes" share this machine's cores: one thread a rank (OpenMP spins when oversubscribed).
    generate = ["-m", "nanoserve_cli", "generate", "-m", str(tiny_model_dir), "--max-tokens", "8",
                "--tensor-parallel-size", "2", "--threads", "1", "The capital of France is"]
    launch = [torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
              "--master-port", port]
    # Two machines' ranks would share no memory: the forward's collectives stay gloo's.
    env = {**os.environ, "NANOSERVE_TP_SHARED_MEMORY": "0"}
    nodes = [subprocess.Popen([*launch, "--node-rank", str(rank), *generate], cwd=REPO, text=True, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank in (0, 1)]
    try:
        outputs = [node.communicate(timeout=300) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    _, _, one = solo
    alone = one.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0.0))
    assert outputs[0][0] in (alone[0].outputs[0].text, alone[0].outputs[0].text + "\n")


def test_a_served_engine_whose_worker_dies_answers_503_then_the_server_exits_naming_the_rank(
        tiny_model_dir, tmp_path):
    """`nanoserve serve --tensor-parallel-size 2`: killing rank 1 mid-request fails the request
    in flight with a 503 (not a hang, not a 500), and the process exits non-zero naming rank 1."""
    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    base_url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    command = [sys.executable, "-c", "from nanoserve_cli.main import app; app()", "serve", "--model",
               str(tiny_model_dir), "--port", str(port), "--tensor-parallel-size", "2", "--threads", "1",
               "--log-level", "warning"]
    with log_path.open("w") as log:
        server = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                  env={**os.environ, "NANOSERVE_TP_TIMEOUT_S": "5"})
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.1)
        (worker,) = _children_running(server.pid, "nanoserve.worker")
        answer: list[httpx.Response] = []
        body = {"prompt": "Hello", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
        request = threading.Thread(target=lambda: answer.append(
            httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)))
        request.start()
        while "nanoserve_requests_running" not in _running_lines(base_url):
            assert request.is_alive(), "the request finished before the worker was killed"
            time.sleep(0.02)
        os.kill(worker, signal.SIGKILL)
        request.join(timeout=60)
        status = server.wait(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=10)
    assert answer and answer[0].status_code == 503, answer and answer[0].text
    assert answer[0].json()["error"]["code"] == "service_unavailable"
    assert status != 0
    assert "rank 1" in log_path.read_text()


def _children_running(pid: int, module: str) -> list[int]:
    """The child processes of `pid` (spawned by any of its threads) whose command line names `module`."""
    children = [int(child) for task in Path(f"/proc/{pid}/task").iterdir()
                for child in (task / "children").read_text().split()]
    return [child for child in children if module in Path(f"/proc/{child}/cmdline").read_text()]


def _running_lines(base_url: str) -> str:
    """The /metrics lines that show a running sequence (empty while none runs)."""
    import httpx

    text = httpx.get(f"{base_url}/metrics", timeout=5).text
    return "\n".join(line for line in text.splitlines()
                     if line.startswith("nanoserve_requests_running{") and float(line.split()[-1]) > 0)
