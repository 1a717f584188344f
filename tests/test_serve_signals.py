"""`nanoserve serve` as a real process, and the signals it obeys.

A second SIGTERM or SIGINT ends the drain at once: the first signal starts a drain long enough
that the test would time out waiting for it; the second must end the server now, give the
stream in flight its error event and `[DONE]`, and exit 128 + the signal's number (a forced
stop, not the clean 0 of a drain that finished). SIGHUP re-reads the API keys file. A signal
while the model loads (the engine thread inside torch) exits cleanly, never by an abort.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
DRAIN_S = 600  # far past every wait below: only the second signal can end the server in time


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def health(base_url: str) -> int | None:
    """/health's status, or None once the server no longer accepts connections."""
    try:
        return httpx.get(f"{base_url}/health", timeout=2).status_code
    except httpx.TransportError:
        return None


def wait_until(predicate, what: str, log_path: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what}:\n{log_path.read_text()[-3000:]}"
        time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_second_signal_ends_the_drain_at_once_with_error_events(tiny_model_dir, tmp_path, sig) -> None:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    command = [sys.executable, "-c", "from nanoserve_cli.main import app; app()", "serve",
               "--model", str(tiny_model_dir), "--port", str(port), "--drain-s", str(DRAIN_S),
               "--log-level", "warning"]
    with log_path.open("w") as log:
        process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        wait_until(lambda: health(base_url) == 200, "the server never became healthy", log_path)
        # Four choices of 480 tokens: many seconds of decoding, so the stream is still running
        # when the second signal comes.
        body = {"prompt": "Tell me a long story.", "max_tokens": 480, "n": 4, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            process.send_signal(sig)
            wait_until(lambda: health(base_url) != 200, "the first signal did not start a drain", log_path)
            process.send_signal(sig)
            events = [first] + [line for line in lines if line.startswith("data: ")]
        code = process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
    assert code == 128 + sig, log_path.read_text()[-3000:]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert "second shutdown signal" in error["message"]
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-2]]
    finished = [choice for chunk in chunks for choice in chunk["choices"] if choice.get("finish_reason")]
    assert finished == []  # cut, not finished: the drain had far longer to go


def test_sighup_re_reads_the_keys_file(tiny_model_dir, tmp_path) -> None:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log_path, keys = tmp_path / "serve.log", tmp_path / "keys"
    keys.write_text("alice alice-key\nbob bob-key\n")
    command = [sys.executable, "-c", "from nanoserve_cli.main import app; app()", "serve",
               "--model", str(tiny_model_dir), "--port", str(port), "--api-keys-file", str(keys),
               "--log-level", "warning"]

    def status(key: str) -> int:
        return httpx.get(f"{base_url}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code

    with log_path.open("w") as log:
        process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        wait_until(lambda: health(base_url) == 200, "the server never became healthy", log_path)
        assert (status("alice-key"), status("carol-key")) == (200, 401)
        keys.write_text("bob bob-key\ncarol carol-key\n")
        process.send_signal(signal.SIGHUP)
        wait_until(lambda: (status("alice-key"), status("carol-key")) == (401, 200),
                   "SIGHUP did not reload the keys", log_path, timeout_s=20)
        assert status("bob-key") == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, log_path.read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


# From right after the start to well into the load: with no kernel verdict cached, the engine
# thread measures the linear kernels (torch work) after the weights load.
LOADING_MOMENTS_S = (0.0, 0.5, 1.5, 3.0)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_the_model_loads_exits_cleanly_never_by_an_abort(tiny_model_dir, tmp_path, sig):
    """Exit 0 (the load called off, the thread joined), or 128 + the signal / killed by it when
    it comes before the server installs its handlers; never 134 with "terminate called"."""
    outcomes = []
    for moment_s in LOADING_MOMENTS_S:
        cache = tmp_path / f"cache-{moment_s}"
        command = [sys.executable, "-c", "from nanoserve_cli.main import app; app()", "serve",
                   "--model", str(tiny_model_dir), "--port", str(free_port()), "--log-level", "warning"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "NANOSERVE_CACHE": str(cache)}
        process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   text=True, env=env)
        try:
            time.sleep(moment_s)
            process.send_signal(sig)
            _, stderr = process.communicate(timeout=120)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
        outcomes.append((moment_s, process.returncode, stderr))
    for moment_s, code, stderr in outcomes:
        assert code in (0, 128 + sig, -sig), f"at {moment_s} s: exit {code}\n{stderr[-3000:]}"
        assert "terminate called" not in stderr and "Fatal Python error" not in stderr, stderr[-3000:]
