"""API keys as tenants: what one tenant's requests may and may not see of another's.

Two tenants (alice and bob) on one server: by default neither finds the other's cached prefix
(`cached_tokens`), each tenant's HTTP requests share one fair share parent, a tenant over its
concurrency limit gets a 429 while the other is served, and /metrics counts each by name and
never shows a key. One key or none behaves as it did before tenants; the keys file re-reads.
The metrics are read with prometheus_client's own parser.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import BackgroundServer

from nanoserve.config import EngineConfig
from nanoserve.engine.core import Engine
from nanoserve.server.app import build_app, reload_keys
from nanoserve.server.tenants import (
    Tenancy,
    TenancyError,
    Tenant,
    check_distinct,
    find_tenant,
    read_keys_file,
    tenants_from_options,
)

ALICE, BOB = "alice-key-0123", "bob-key-4567"
PROMPT = list(range(200, 240))  # 40 token ids: two full 16-token blocks, then 8 more


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@contextlib.contextmanager
def serving(model_dir: Path, tenancy: Tenancy) -> Iterator[tuple[str, object]]:
    def engine() -> Engine:
        return Engine(EngineConfig(model=str(model_dir), num_kv_blocks=96, max_num_seqs=8))

    app = build_app(engine, model_names=["tiny"], tenancy=tenancy)
    with BackgroundServer(app) as server:
        deadline = time.monotonic() + 60
        while httpx.get(f"{server.base_url}/health").status_code != 200:
            assert time.monotonic() < deadline, "the server never became healthy"
            time.sleep(0.05)
        yield server.base_url, app


def two_tenants(tmp_path: Path, **options) -> Tenancy:
    keys = tmp_path / "keys"
    keys.write_text(f"# name key\nalice {ALICE}\n\nbob {BOB}\n")
    return Tenancy(keys_file=keys, **options)


def cached_tokens(base_url: str, key: str, **fields) -> int:
    body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, **fields}
    response = httpx.post(f"{base_url}/v1/completions", json=body, headers=bearer(key), timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def samples(base_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{base_url}/metrics").text
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def tenant_value(values: dict, name: str, tenant: str, **labels: str) -> float:
    wanted = tuple(sorted({"model_name": "tiny", "tenant": tenant, **labels}.items()))
    return values[(name, wanted)]


# -- keys -----------------------------------------------------------------------------------------

def test_a_bearer_token_finds_its_own_tenant_and_no_other() -> None:
    tenants = (Tenant("alice", ALICE), Tenant("bob", BOB))
    assert find_tenant(tenants, ALICE).name == "alice"
    assert find_tenant(tenants, BOB).name == "bob"
    for guess in ("", ALICE[:-1], ALICE + "x", BOB.upper()):
        assert find_tenant(tenants, guess) is None


def test_keys_file_lines_name_their_tenants_and_bad_lines_are_refused_naming_the_line(tmp_path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"alice {ALICE}\n  # a comment\nbob {BOB}\n")
    assert [t.name for t in read_keys_file(keys)] == ["alice", "bob"]
    for text, says in ((f"alice {ALICE}\ncarol\n", "line 2"), (f"alice {ALICE} extra\n", "line 1"),
                       ("alice clé\n", "printable ASCII"), ("", "no keys")):
        keys.write_text(text)
        with pytest.raises(TenancyError, match=says) as refused:
            read_keys_file(keys)
        assert ALICE not in str(refused.value)  # a key is never echoed
    with pytest.raises(TenancyError, match="cannot be read"):
        read_keys_file(tmp_path / "missing")


def test_a_duplicate_key_or_name_is_refused_naming_the_tenants_not_the_key() -> None:
    with pytest.raises(TenancyError, match=r"'bob' is also the key of tenant 'alice'") as refused:
        check_distinct([Tenant("alice", ALICE), Tenant("bob", ALICE)])
    assert ALICE not in str(refused.value)
    with pytest.raises(TenancyError, match="'alice' is given twice"):
        check_distinct([Tenant("alice", ALICE), Tenant("alice", BOB)])
    with pytest.raises(TenancyError, match="--api-key number 2"):
        tenants_from_options([ALICE, ""])


def test_the_cache_scope_is_tenant_with_two_keys_and_shared_with_one_or_none(tmp_path) -> None:
    assert two_tenants(tmp_path).scope == "tenant"
    assert Tenancy(tuple(tenants_from_options([ALICE]))).scope == "shared"
    assert Tenancy().scope == "shared"
    assert two_tenants(tmp_path, cache_scope="shared").scope == "shared"


# -- the prefix cache ---------------------------------------------------------------------------

def test_no_tenant_finds_anothers_cached_prefix_by_default(tiny_model_dir, tmp_path) -> None:
    with serving(tiny_model_dir, two_tenants(tmp_path)) as (base_url, _):
        assert cached_tokens(base_url, ALICE) == 0
        assert cached_tokens(base_url, BOB) == 0  # alice's prompt tells bob nothing
        assert cached_tokens(base_url, ALICE) == 32  # her own cache still serves her
        assert cached_tokens(base_url, BOB) == 32
        # One cache_salt sent by both tenants still shares nothing between them.
        assert cached_tokens(base_url, ALICE, cache_salt="team") == 0
        assert cached_tokens(base_url, BOB, cache_salt="team") == 0
        assert cached_tokens(base_url, ALICE, cache_salt="team") == 32


def test_a_shared_scope_and_a_single_key_share_the_cache_as_before(tiny_model_dir, tmp_path) -> None:
    with serving(tiny_model_dir, two_tenants(tmp_path, cache_scope="shared")) as (base_url, _):
        assert cached_tokens(base_url, ALICE) == 0
        assert cached_tokens(base_url, BOB) == 32
    with serving(tiny_model_dir, Tenancy(tuple(tenants_from_options([ALICE])))) as (base_url, _):
        assert cached_tokens(base_url, ALICE) == 0
        assert cached_tokens(base_url, ALICE) == 32
        assert cached_tokens(base_url, ALICE, cache_salt="mine") == 0  # a request's salt still counts


# -- the fair share -------------------------------------------------------------------------------

def test_each_tenants_requests_share_one_fair_share_parent(tiny_model_dir, tmp_path, monkeypatch) -> None:
    with serving(tiny_model_dir, two_tenants(tmp_path)) as (base_url, app):
        engine = app.state.server.engine
        parents: list[tuple[str, str | None]] = []
        add_request = engine.add_request

        def recording(*args, parent_id=None, **kwargs):
            parents.append(parent_id)
            return add_request(*args, parent_id=parent_id, **kwargs)

        monkeypatch.setattr(engine, "add_request", recording)
        for key in (ALICE, ALICE, BOB):
            body = {"prompt": "Hi", "n": 2, "max_tokens": 1}
            assert httpx.post(f"{base_url}/v1/completions", json=body, headers=bearer(key)).status_code == 200
    # Two HTTP requests of alice: one parent; bob's: another.
    assert parents[:4] == [parents[0]] * 4 and parents[4:] == [parents[4]] * 2
    assert parents[0] != parents[4]


# -- the concurrency limit and the metrics ------------------------------------------------------

@contextlib.contextmanager
def alice_holds_her_slot(base_url: str, app) -> Iterator[threading.Event]:
    """Alice's one allowed request streaming, the engine's steps held until the gate is set."""
    async_engine = app.state.server.async_engine
    gate = threading.Event()
    step = async_engine.engine.step

    def held_step():
        gate.wait(5)
        return step()

    async_engine.engine.step = held_step
    # ignore_eos: a sampled EOS would end her stream early and the token counts below would vary.
    body = {"prompt": "Hi", "max_tokens": 4, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, headers=bearer(ALICE),
                      timeout=30) as response:
        while async_engine.num_in_flight == 0:
            time.sleep(0.01)
        yield gate
        # Read her stream to its end: closing it early would cancel her request after however many
        # tokens a busy machine had produced, and the token counts below would vary.
        gate.set()
        for _ in response.iter_bytes():
            pass


def test_a_tenant_over_its_limit_gets_429_while_another_is_served(tiny_model_dir, tmp_path) -> None:
    one_token = {"prompt": "Hi", "max_tokens": 1, "ignore_eos": True}  # counts that cannot vary
    with serving(tiny_model_dir, two_tenants(tmp_path, max_concurrent=1)) as (base_url, app):
        with alice_holds_her_slot(base_url, app) as gate:
            second = httpx.post(f"{base_url}/v1/completions", json=one_token,
                                headers=bearer(ALICE))
            assert second.status_code == 429, second.text
            assert second.headers["retry-after"] == "1"
            assert second.json()["error"]["code"] == "rate_limit_exceeded"
            during = samples(base_url)
            gate.set()
            other = httpx.post(f"{base_url}/v1/completions", json=one_token,
                               headers=bearer(BOB), timeout=30)
            assert other.status_code == 200, other.text
        deadline = time.monotonic() + 10
        while app.state.server.tenancy.in_flight["alice"]:
            assert time.monotonic() < deadline, "alice's stream never left the count"
            time.sleep(0.02)
        again = httpx.post(f"{base_url}/v1/completions", json=one_token,
                           headers=bearer(ALICE), timeout=30)
        assert again.status_code == 200, again.text
        after = samples(base_url)
        text = httpx.get(f"{base_url}/metrics").text
    assert tenant_value(during, "nanoserve_tenant_requests_in_flight", "alice") == 1
    assert tenant_value(during, "nanoserve_tenant_requests_in_flight", "bob") == 0
    assert tenant_value(after, "nanoserve_tenant_requests_rejected_total", "alice") == 1
    assert tenant_value(after, "nanoserve_tenant_requests_rejected_total", "bob") == 0
    assert tenant_value(after, "nanoserve_tenant_request_success_total", "bob", finished_reason="length") == 1
    assert tenant_value(after, "nanoserve_tenant_generation_tokens_total", "alice") == 5
    assert tenant_value(after, "nanoserve_tenant_generation_tokens_total", "bob") == 1
    assert ALICE not in text and BOB not in text


# Every generation endpoint counts against the one limit, each refusing in its own protocol's shape.
LIMITED_ENDPOINTS = {
    "/v1/chat/completions": ({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
                             lambda body: body["error"]["code"] == "rate_limit_exceeded"),
    "/v1/messages": ({"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]},
                     lambda body: body["type"] == "error" and body["error"]["type"] == "rate_limit_error"),
    "/v1/responses": ({"model": "tiny", "input": "Hi", "max_output_tokens": 1},
                      lambda body: body["error"]["code"] == "rate_limit_exceeded"),
    "/v1/embeddings": ({"model": "tiny", "input": "Hi"},
                       lambda body: body["error"]["code"] == "rate_limit_exceeded"),
}


@pytest.mark.parametrize("path", sorted(LIMITED_ENDPOINTS))
def test_every_generation_endpoint_counts_against_the_tenants_limit(tiny_model_dir, tmp_path, path) -> None:
    body, refused_in_its_shape = LIMITED_ENDPOINTS[path]
    with serving(tiny_model_dir, two_tenants(tmp_path, max_concurrent=1)) as (base_url, app), \
            alice_holds_her_slot(base_url, app) as gate:
        refused = httpx.post(f"{base_url}{path}", json=body, headers=bearer(ALICE), timeout=30)
        gate.set()
        served_elsewhere = httpx.post(f"{base_url}{path}", json=body, headers=bearer(BOB), timeout=30)
    assert refused.status_code == 429, refused.text
    assert refused.headers["retry-after"] == "1"
    assert refused_in_its_shape(refused.json()), refused.text
    assert served_elsewhere.status_code == 200, served_elsewhere.text


def test_the_keys_file_is_re_read_and_a_broken_one_keeps_the_keys_in_use(tiny_model_dir, tmp_path) -> None:
    tenancy = two_tenants(tmp_path)
    with serving(tiny_model_dir, tenancy) as (base_url, app):
        carol = "carol-key-89ab"

        def status(key: str) -> int:
            return httpx.get(f"{base_url}/v1/models", headers=bearer(key)).status_code

        def reload_and_wait(expected: dict[str, int]) -> None:
            reload_keys(app)
            deadline = time.monotonic() + 10
            while {key: status(key) for key in expected} != expected:
                assert time.monotonic() < deadline, {key: status(key) for key in expected}
                time.sleep(0.02)

        tenancy.keys_file.write_text(f"bob {BOB}\ncarol {carol}\n")
        reload_and_wait({ALICE: 401, BOB: 200, carol: 200})
        tenancy.keys_file.write_text(f"bob {BOB}\ncarol {BOB}\n")  # a duplicate: refused
        reload_and_wait({ALICE: 401, BOB: 200, carol: 200})
        assert tenant_value(samples(base_url), "nanoserve_tenant_requests_in_flight", "carol") == 0
