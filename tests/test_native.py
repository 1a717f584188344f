"""The native kernel library: built once per machine, found again, and never required."""

import shutil
import subprocess

import pytest

from nanoserve import native
from nanoserve.native import build
from nanoserve.native.attention import ISAS

needs_compiler = pytest.mark.skipif(build.compiler() is None, reason="no C compiler on this machine")


@needs_compiler
def test_first_build_compiles_and_a_second_compiles_nothing(tmp_path, monkeypatch):
    first = build.build_library(cache_dir=tmp_path)
    assert first.path is not None and first.path.is_file(), first.reason
    assert first.compile_s > 0

    def no_compiling(command, *args, **kwargs):
        if "--version" not in command:
            raise AssertionError(f"a second build ran the compiler: {command}")
        return subprocess.CompletedProcess(command, 0, stdout=first_version, stderr="")

    first_version = subprocess.run([build.compiler(), "--version"], capture_output=True, text=True).stdout
    monkeypatch.setattr(build.subprocess, "run", no_compiling)
    second = build.build_library(cache_dir=tmp_path)
    assert (second.path, second.compile_s) == (first.path, 0.0)


@needs_compiler
def test_an_edited_source_builds_anew(tmp_path):
    sources = tmp_path / "csrc"
    shutil.copytree(build.SOURCE_DIR, sources)
    before = build.build_library(sources, tmp_path / "cache")
    runtime = sources / "runtime" / "runtime.c"
    runtime.write_text(runtime.read_text() + "\n/* edited */\n")
    after = build.build_library(sources, tmp_path / "cache")
    assert before.path != after.path and after.compile_s > 0


@needs_compiler
def test_a_source_in_a_subfolder_is_built_and_keys_the_build(tmp_path):
    sources = tmp_path / "csrc"
    shutil.copytree(build.SOURCE_DIR, sources)
    cc = build.compiler()
    files = sorted(sources.rglob("*.[ch]"))
    assert sources / "arch" / "x86" / "wide_tiles.c" in files
    before = build.build_key(files, cc, sources)
    nested = sources / "arch" / "x86" / "wide_tiles.c"
    nested.write_text(nested.read_text() + "\n/* edited */\n")
    assert build.build_key(files, cc, sources) != before


@needs_compiler
def test_a_source_that_does_not_compile_gives_no_library_and_says_why(tmp_path):
    sources = tmp_path / "csrc"
    sources.mkdir()
    (sources / "broken.c").write_text("int broken(void) { return not_declared; }\n")
    result = build.build_library(sources, tmp_path / "cache")
    assert result.path is None
    assert "native build failed" in result.reason and "not_declared" in result.reason
    assert not list((tmp_path / "cache").rglob("*.tmp"))


def test_without_a_compiler_there_is_no_library_and_the_reason_names_it(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    result = build.build_library(cache_dir=tmp_path)
    assert result.path is None and "no C compiler" in result.reason


@pytest.fixture
def fresh_load(monkeypatch):
    native._load.cache_clear()
    yield monkeypatch
    native._load.cache_clear()


def test_nanoserve_no_native_turns_the_library_off_and_says_so(fresh_load):
    fresh_load.setenv("NANOSERVE_NO_NATIVE", "1")
    assert native.library() is None
    assert native.status() == "native kernels: off (NANOSERVE_NO_NATIVE=1); running torch kernels"


def test_without_a_compiler_the_start_up_line_says_torch_kernels_run(fresh_load, tmp_path):
    fresh_load.delenv("NANOSERVE_NO_NATIVE", raising=False)
    fresh_load.setenv("CC", str(tmp_path / "no-such-cc"))
    fresh_load.setenv("NANOSERVE_CACHE", str(tmp_path / "cache"))
    assert native.library() is None
    assert "off (no C compiler" in native.status() and "running torch kernels" in native.status()


@needs_compiler
def test_the_library_loads_with_its_abi_version_and_isa(fresh_load):
    fresh_load.delenv("NANOSERVE_NO_NATIVE", raising=False)
    library = native.library()
    assert library is not None, native.status()
    assert library.lib.ns_abi_version() == native.ABI_VERSION
    assert library.isa in ("avx2", "portable")
    assert native.status().startswith(f"native kernels: on ({library.isa}; ")
    # The attention picks its own path by cpuid: the line names the widest of those it runs.
    paths = [name for name, bit in ISAS.items() if library.lib.ns_attention_isas() & bit]
    assert f"; attention on {paths[-1]}; " in native.status()


@pytest.fixture
def float_matmul():
    import torch

    from nanoserve.native import matmul

    if native.library() is None:
        pytest.skip(native.status())
    generator = torch.Generator().manual_seed(0)
    packed = matmul.pack(torch.randn(256, 512, generator=generator))
    x = torch.randn(8, 512, generator=generator)
    return lambda: matmul.matmul(x, packed, threads=2)


def test_the_thread_pool_starts_its_workers_once_and_every_call_reuses_them(float_matmul):
    import torch

    first = float_matmul()
    started = native.library().lib.ns_pool_workers()
    assert started >= 1
    for _ in range(50):
        assert torch.equal(float_matmul(), first)
    assert native.library().lib.ns_pool_workers() == started


def test_callers_on_two_threads_at_once_each_get_their_own_bits(float_matmul):
    # The second caller finds the pool busy and runs its call inline, on one thread.
    import threading

    import torch

    expected, mismatches = float_matmul(), []

    def call_many() -> None:
        mismatches.extend(i for i in range(200) if not torch.equal(float_matmul(), expected))

    threads = [threading.Thread(target=call_many) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and mismatches == []
