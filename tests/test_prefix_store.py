"""The prefix cache's disk tier (`--prefix-cache-dir`, engine/prefix_store.py): a prompt served
again after a restart reads its cached blocks from disk (its prefill computes only the tail)
and gives the cold run's tokens and logprobs bit for bit; a corrupt, truncated or foreign file
is skipped with a log line, never loaded; the directory keeps to its size limit, least
recently used files going first."""

import json
import os
import random
from pathlib import Path

import httpx
import pytest
import torch
from server_harness import BackgroundServer
from test_server_api import wait_healthy
from tiny_model import write_tiny_llama

from nanoserve.config import EngineConfig
from nanoserve.engine.block_pool import block_keys
from nanoserve.engine.core import Engine
from nanoserve.engine.prefix_store import SUFFIX, PrefixStore
from nanoserve.errors import InvalidRequestError
from nanoserve.loading.weights import read_config
from nanoserve.model.kv_cache import KVCache
from nanoserve.sampling_params import SamplingParams
from nanoserve.server.app import build_app

BLOCK = 16
PROMPT = random.Random(7).choices(range(3, 300), k=2000)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)


def long_context_model(path: Path, seed: int) -> Path:
    """A tiny model whose context holds a 2,000-token prompt."""
    write_tiny_llama(path, seed=seed)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 4096
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return long_context_model(tmp_path_factory.mktemp("tiny_long"), seed=0)


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory) -> Path:
    return long_context_model(tmp_path_factory.mktemp("tiny_long_other"), seed=1)


# The linear kernel is chosen by measurement at start-up and may flip between engines on a busy
# machine; blocks are bound to it (a flip is a miss), so every engine here runs the first one's.
_first_kernel: dict[str, str] = {}


def make_engine(model_dir: Path, cache_dir: Path | None, num_kv_blocks: int = 160, **options) -> Engine:
    options.setdefault("linear_kernel", _first_kernel.get("name"))
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", device="cpu", block_size=BLOCK,
                                 num_kv_blocks=num_kv_blocks, max_num_batched_tokens=512, threads=1,
                                 prefix_cache_dir=None if cache_dir is None else str(cache_dir), **options))
    _first_kernel.setdefault("name", engine.kernel_choice.kernel.name)
    return engine


def serve(engine: Engine, prompt: list[int]) -> tuple[list[int], list]:
    request_id = engine.add_request(prompt, GREEDY)
    tokens, logprobs = [], []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == request_id
            tokens += out.token_ids
            logprobs += out.logprobs
    assert engine.pool.is_completely_free
    return tokens, logprobs


@pytest.fixture(scope="module")
def cold(model_dir) -> tuple[list[int], list]:
    """The prompt's output from an engine with no directory at all."""
    engine = make_engine(model_dir, None)
    try:
        return serve(engine, PROMPT)
    finally:
        engine.close()


def block_file(cache_dir: Path, index: int) -> Path:
    """The file of the prompt's block `index` (the one namespace in `cache_dir`)."""
    key = block_keys(PROMPT, BLOCK, index + 1)[index]
    (path,) = cache_dir.glob(f"*/{key.hex()}{SUFFIX}")
    return path


def written(model_dir: Path, cache_dir: Path) -> None:
    engine = make_engine(model_dir, cache_dir)
    serve(engine, PROMPT)
    engine.close()


def test_a_restart_reads_the_prefix_from_disk_with_identical_output(model_dir, cold, tmp_path):
    first = make_engine(model_dir, tmp_path)
    assert serve(first, PROMPT) == cold
    assert first.stats.prompt_tokens == len(PROMPT)
    first.close()
    assert first.prefix_store.written_blocks >= len(PROMPT) // BLOCK

    second = make_engine(model_dir, tmp_path)
    try:
        assert serve(second, PROMPT) == cold
        cached_blocks = (len(PROMPT) - 1) // BLOCK  # the last token is always computed
        assert second.prefix_store.loaded_blocks == cached_blocks
        assert second.stats.prompt_tokens == len(PROMPT) - cached_blocks * BLOCK
    finally:
        second.close()


def test_a_block_evicted_from_the_pool_is_read_back_from_disk(model_dir, tmp_path):
    rng = random.Random(3)
    short, other = rng.choices(range(3, 300), k=300), rng.choices(range(3, 300), k=600)
    engine = make_engine(model_dir, tmp_path, num_kv_blocks=40)
    try:
        first = serve(engine, short)
        serve(engine, other)  # needs most of the short prompt's blocks: evicted, so written
        cached = (len(short) - 1) // BLOCK
        in_memory = len(engine.pool.lookup(block_keys(short, BLOCK, cached)))
        assert in_memory < cached
        assert serve(engine, short) == first
        assert engine.prefix_store.loaded_blocks == cached - in_memory
    finally:
        engine.close()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_file_is_skipped_with_a_log_line(model_dir, cold, tmp_path, caplog, damage):
    written(model_dir, tmp_path)
    path = block_file(tmp_path, 10)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-5] ^= 0x40
    else:
        del data[len(data) // 2:]
    path.write_bytes(bytes(data))
    engine = make_engine(model_dir, tmp_path)
    try:
        with caplog.at_level("WARNING", logger="nanoserve"):
            assert serve(engine, PROMPT) == cold
        assert engine.prefix_store.loaded_blocks == 10  # the blocks before it; the rest computed
        assert engine.prefix_store.skipped_files == 1
        assert any(str(path) in r.getMessage() and "skipped" in r.getMessage() for r in caplog.records)
    finally:
        engine.close()


def test_another_models_directory_is_not_used(model_dir, other_model_dir, cold, tmp_path, caplog):
    written(other_model_dir, tmp_path)
    with caplog.at_level("INFO", logger="nanoserve"):
        engine = make_engine(model_dir, tmp_path)
    try:
        assert any("of other models or settings" in r.getMessage() for r in caplog.records)
        assert serve(engine, PROMPT) == cold
        assert engine.prefix_store.loaded_blocks == 0
    finally:
        engine.close()


def test_a_foreign_file_under_this_models_name_is_refused_by_its_header(model_dir, other_model_dir, cold,
                                                                         tmp_path, caplog):
    written(model_dir, tmp_path)
    ours = block_file(tmp_path, 0)
    theirs_dir = tmp_path / "theirs"
    written(other_model_dir, theirs_dir)
    ours.write_bytes(block_file(theirs_dir, 0).read_bytes())  # the same key, another model's K/V
    engine = make_engine(model_dir, tmp_path)
    try:
        with caplog.at_level("WARNING", logger="nanoserve"):
            assert serve(engine, PROMPT) == cold
        assert engine.prefix_store.loaded_blocks == 0
        assert any("another model" in r.getMessage() for r in caplog.records)
    finally:
        engine.close()


def test_another_kv_cache_dtype_does_not_read_the_blocks(model_dir, tmp_path):
    written(model_dir, tmp_path)
    engine = make_engine(model_dir, tmp_path, kv_cache_dtype="q8_0")
    try:
        serve(engine, PROMPT)
        assert engine.prefix_store.loaded_blocks == 0
    finally:
        engine.close()
    assert len([d for d in tmp_path.iterdir() if d.is_dir()]) == 2  # a namespace each


def test_q8_0_blocks_come_back_with_their_scales(model_dir, tmp_path):
    first = make_engine(model_dir, tmp_path, kv_cache_dtype="q8_0")
    reference = serve(first, PROMPT)
    first.close()
    second = make_engine(model_dir, tmp_path, kv_cache_dtype="q8_0")
    try:
        assert serve(second, PROMPT) == reference
        assert second.prefix_store.loaded_blocks == (len(PROMPT) - 1) // BLOCK
    finally:
        second.close()


def test_a_server_writes_its_prefix_cache_when_it_stops(model_dir, tmp_path):
    app = build_app(lambda: make_engine(model_dir, tmp_path), model_names=["tiny"])
    with BackgroundServer(app) as server:
        wait_healthy(server.base_url)
        answer = httpx.post(f"{server.base_url}/v1/completions", timeout=120,
                            json={"model": "tiny", "prompt": PROMPT[:200], "max_tokens": 2})
        assert answer.status_code == 200, answer.text
    assert block_file(tmp_path, 200 // BLOCK - 1).exists()  # the prompt's last full block


def small_store(model_dir: Path, root: Path, max_blocks: int) -> tuple[PrefixStore, KVCache]:
    kv_cache = KVCache(read_config(model_dir), 8, 4, torch.float32, torch.device("cpu"))
    probe = PrefixStore(root / "probe", {"probe": 1}, 1 << 30, kv_cache)
    probe.save([(0, b"\0" * 32)])
    probe.close()
    (size,) = probe._files.values()
    return PrefixStore(root / "cache", {"model": "tiny"}, max_blocks * size, kv_cache), kv_cache


def test_the_size_limit_deletes_the_least_recently_used_files(model_dir, tmp_path):
    keys = [bytes([i]) * 32 for i in range(6)]
    store, kv_cache = small_store(model_dir, tmp_path, max_blocks=4)
    for index in range(4):
        kv_cache.k[0][:, index] = float(index + 1)
        store.save([(index, keys[index])])
    store.close()
    for age, key in enumerate(keys[:4]):  # a restart orders the files by their mtime: k0 oldest
        os.utime(store._path(key), (1_000 + age, 1_000 + age))
    store, kv_cache = small_store(model_dir, tmp_path, max_blocks=4)
    assert store.load(keys[0], 7)  # a use: k0 is now the newest
    assert torch.equal(kv_cache.k[0][:, 7], torch.ones_like(kv_cache.k[0][:, 7]))
    store.save([(4, keys[4])])
    store.close()
    assert [store.has(key) for key in keys[:5]] == [True, False, True, True, True]
    assert sorted(p.name for p in store.dir.glob(f"*{SUFFIX}")) == sorted(
        key.hex() + SUFFIX for key in (keys[0], keys[2], keys[3], keys[4]))


@pytest.mark.parametrize(("options", "param"), [
    ({"enable_prefix_caching": False}, "prefix_cache_dir"),
    ({"tensor_parallel_size": 2}, "prefix_cache_dir"),
    ({"prefix_cache_dir_max_gb": 0.0}, "prefix_cache_dir_max_gb"),
])
def test_settings_it_cannot_keep_are_refused_by_name(model_dir, tmp_path, options, param):
    with pytest.raises(InvalidRequestError) as refused:
        make_engine(model_dir, tmp_path, **options)
    assert refused.value.param == param
