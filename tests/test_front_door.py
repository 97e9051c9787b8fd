"""Who may read what at the HTTP front door (docs/security.md): `/metrics` and `/debug/*` need an operator
credential (the admin key; the scrape key opens `/metrics` only), never a tenant's API key (403); no key or an
unknown one gets 401. A tenant reads its own usage at `/v1/usage`, nothing of another tenant's. An operator key
that is also a tenant's stops the start. HTTPS with --ssl-keyfile / --ssl-certfile, on a real `kvfence serve`.

Every wait polls a condition under a deadline."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvfence.config import Config, from_env
from kvfence.runtime.http import front_door_problem, how_to_call
from tests.pd_cluster import free_port
from tests.server_harness import MODEL, SCRAPE_KEY, Handle, running_server

KEYS = {"key-alice": "alice", "key-bob": "bob"}
ADMIN = "admin-key"
CREDENTIALS = {"none": None, "unknown": "nobody", "tenant": "key-bob", "scrape": SCRAPE_KEY, "admin": ADMIN}
EXPECTED = {  # route -> credential -> status, on a server with tenants, the admin key and the scrape key
    "/metrics": {"none": 401, "unknown": 401, "tenant": 403, "scrape": 200, "admin": 200},
    "/debug/kv": {"none": 401, "unknown": 401, "tenant": 403, "scrape": 403, "admin": 200},
    "/debug/config": {"none": 401, "unknown": 401, "tenant": 403, "scrape": 403, "admin": 200},
    "/v1/usage": {"none": 401, "unknown": 401, "tenant": 200, "scrape": 401, "admin": 401},
    "/v1/models": {"none": 401, "unknown": 401, "tenant": 200, "scrape": 401, "admin": 401},
    "/health": {"none": 200, "unknown": 200, "tenant": 200, "scrape": 200, "admin": 200},
    "/dashboard": {"none": 200, "unknown": 200, "tenant": 200, "scrape": 200, "admin": 200},
}
PROMPT = random.Random(7).choices(range(3, 100), k=41)  # 10 full pages of 4 tokens: 40 tokens can hit
DEADLINE_S = 30.0
NO_OPERATOR_ENV = {"KVFENCE_ADMIN_KEY", "KVFENCE_METRICS_KEY"}  # a caller's shell must not change the outcome


@pytest.fixture(scope="module")
def server(tiny_model) -> Iterator[Handle]:
    with running_server(tiny_model, api_keys=KEYS, admin_key=ADMIN, metrics_key=SCRAPE_KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def traffic(server: Handle) -> Handle:
    """Alice sends PROMPT twice (the second time 40 tokens hit her prefix cache), bob once, naming alice in the
    one field he controls; returns once all three are counted."""
    for key, extra in (("key-alice", {}), ("key-alice", {}), ("key-bob", {"user": "alice"})):
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, **extra}
        r = httpx.post(f"{server.base_url}/completions", json=body, headers=bearer(key), timeout=DEADLINE_S)
        assert r.status_code == 200, r.text
    # a request is counted when the engine reports its end, just after the reply: poll, do not assume
    wait_for(
        lambda: usage(server, "key-alice")["requests"] == 2 and usage(server, "key-bob")["requests"] == 1
    )
    return server


def bearer(key: str | None) -> dict[str, str]:
    return {} if key is None else {"Authorization": f"Bearer {key}"}


def get(srv: Handle, route: str, key: str | None) -> httpx.Response:
    return httpx.get(f"{srv.url}{route}", headers=bearer(key), timeout=DEADLINE_S)


def usage(srv: Handle, key: str) -> dict[str, Any]:
    r = get(srv, "/v1/usage", key)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def wait_for(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, "condition not met before the deadline"
        time.sleep(0.02)  # poll interval


def statuses(srv: Handle, route: str, credentials: dict[str, str | None]) -> dict[str, int]:
    return {name: get(srv, route, key).status_code for name, key in credentials.items()}


# ---- who may read what ----------------------------------------------------------------------------------


@pytest.mark.parametrize("credential", sorted(CREDENTIALS))
@pytest.mark.parametrize("route", sorted(EXPECTED))
def test_each_route_opens_to_its_credentials_only(server, route, credential):
    r = get(server, route, CREDENTIALS[credential])
    assert r.status_code == EXPECTED[route][credential], r.text
    if r.status_code == 403:  # a credential this server knows, without the right
        assert r.json()["error"]["code"] == "permission_denied"
    if r.status_code == 401:
        assert r.json()["error"]["code"] in ("invalid_api_key", "invalid_admin_key")
        assert r.headers["www-authenticate"].startswith("Bearer realm=")


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_operator_keys_are_not_tenants(server, route):
    body = {
        "model": MODEL,
        "prompt": [5, 6],
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
    }
    for key in (SCRAPE_KEY, ADMIN):
        r = httpx.post(f"{server.url}{route}", json=body, headers=bearer(key), timeout=DEADLINE_S)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text


def test_the_metrics_body_reaches_operators_only(traffic):
    bodies = {name: get(traffic, "/metrics", key).text for name, key in CREDENTIALS.items()}
    naming_alice = {name for name, text in bodies.items() if 'tenant="alice"' in text}
    assert naming_alice == {"scrape", "admin"}
    assert 'kvfence_prefix_cache_hit_tokens_total{tenant="alice"} 40.0' in bodies["admin"]
    assert not any("kvfence_" in bodies[name] for name in ("none", "unknown", "tenant"))


def test_a_tenant_reads_its_own_usage_and_nothing_of_another_tenants(traffic):
    bob = get(traffic, "/v1/usage", "key-bob")
    assert bob.json() == {  # bob sent alice's prompt once: it never hits her cache (I7)
        "object": "usage",
        "tenant": "bob",
        "requests": 1,
        "prompt_tokens": 41,
        "completion_tokens": 2,
        "prefix_cache": {"queried_tokens": 41, "hit_tokens": 0},
    }
    assert "alice" not in bob.text
    alice = usage(traffic, "key-alice")
    assert alice["tenant"] == "alice" and (alice["requests"], alice["prompt_tokens"]) == (2, 82)
    assert alice["prefix_cache"] == {"queried_tokens": 82, "hit_tokens": 40}
    assert "bob" not in str(alice)


def test_with_tenants_and_no_operator_key_nobody_reads_metrics(tiny_model):
    with running_server(tiny_model, api_keys=KEYS, metrics_key=None) as srv:
        tenant = get(srv, "/metrics", "key-alice")
        assert tenant.status_code == 403 and "--metrics-key" in tenant.json()["error"]["message"]
        assert get(srv, "/metrics", None).status_code == 401
        assert get(srv, "/debug/kv", "key-alice").status_code == 403
        assert statuses(srv, "/debug/config", {"none": None, "tenant": "key-alice"}) == {
            "none": 401,
            "tenant": 403,
        }


def test_a_single_user_server_serves_metrics_to_anyone_until_an_operator_key_is_set(tiny_model):
    with running_server(tiny_model, metrics_key=None) as srv:  # no --api-keys: every client is `anonymous`
        assert statuses(srv, "/metrics", {"none": None, "any": "whatever"}) == {"none": 200, "any": 200}
        assert usage(srv, "whatever")["tenant"] == "anonymous"
        debug = get(srv, "/debug/kv", None)  # it shows prompts: never without the admin key
        assert debug.status_code == 401 and "--admin-key" in debug.json()["error"]["message"]
    with running_server(tiny_model, metrics_key=SCRAPE_KEY) as srv:
        got = statuses(srv, "/metrics", {"none": None, "unknown": "whatever", "scrape": SCRAPE_KEY})
        assert got == {"none": 401, "unknown": 401, "scrape": 200}
        assert get(srv, "/debug/kv", SCRAPE_KEY).status_code == 403


# ---- refusals at startup --------------------------------------------------------------------------------


@pytest.fixture
def keys_file(tmp_path) -> Path:
    path = tmp_path / "keys.json"
    path.write_text('{"key-alice": "alice"}')
    return path


def test_an_operator_key_that_is_a_tenants_key_or_a_bad_tls_file_is_a_config_error(tmp_path, keys_file):
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not PEM")
    missing = str(tmp_path / "missing.pem")
    for fields, problem in (
        ({"admin_key": "key-alice"}, "--admin-key is also the API key of tenant 'alice'"),
        ({"metrics_key": "key-alice"}, "--metrics-key is also the API key of tenant 'alice'"),
        ({"ssl_keyfile": missing, "ssl_certfile": str(garbage)}, f"--ssl-keyfile {missing}: cannot read it"),
        (
            {"ssl_keyfile": str(garbage), "ssl_certfile": str(tmp_path)},
            f"--ssl-certfile {tmp_path}: cannot read",
        ),
        ({"ssl_keyfile": str(garbage), "ssl_certfile": str(garbage)}, "not a usable certificate and key"),
    ):
        config = Config.of(api_keys=str(keys_file), **fields)
        assert problem in (front_door_problem(config, "serve") or ""), fields
    assert (
        front_door_problem(Config.of(api_keys=str(keys_file), admin_key="adm", metrics_key="scr"), "serve")
        is None
    )
    with pytest.raises(ValueError, match="go together"):
        Config.of(ssl_keyfile=str(garbage))
    with pytest.raises(ValueError, match="must differ"):
        Config.of(admin_key="same", metrics_key="same")


def test_the_scrape_key_comes_from_its_variable_and_stays_secret():
    config = from_env(Config(), {"KVFENCE_METRICS_KEY": "scr4pe"})
    assert config.server.metrics_key == "scr4pe"
    assert "scr4pe" not in config.to_json() and "metrics_key=<set>" in config.describe()


def kvfence(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in NO_OPERATOR_ENV}
    return subprocess.run(
        [sys.executable, "-m", "kvfence", *args], capture_output=True, text=True, timeout=120, env=env
    )


def test_every_http_command_stops_with_exit_2_before_loading(tmp_path, keys_file, tiny_dir):
    missing = str(tmp_path / "missing.pem")
    for command, flags, problem in (
        (["serve"], ["--admin-key", "key-alice"], "--admin-key is also the API key of tenant 'alice'"),
        (["router", "--insecure-cluster"], ["--metrics-key", "key-alice"], "--metrics-key is also"),
        (["serve", "--mode", "pd", "--insecure-cluster"], ["--ssl-keyfile", missing, "--ssl-certfile", missing],
         f"--ssl-keyfile {missing}: cannot read it"),
        (["router", "--insecure-cluster"], ["--ssl-certfile", missing], "go together"),
    ):  # fmt: skip
        done = kvfence(*command, "--model", str(tiny_dir), "--api-keys", str(keys_file), *flags)
        assert done.returncode == 2 and problem in done.stderr, (command, flags, done.stderr[-500:])


# ---- HTTPS ----------------------------------------------------------------------------------------------


def test_how_to_call_names_the_scheme():
    assert "https://127.0.0.1:8443/v1/chat/completions" in how_to_call("0.0.0.0", 8443, "m", False, tls=True)
    assert "http://127.0.0.1:8000/v1/chat/completions" in how_to_call("127.0.0.1", 8000, "m", False)


def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is missing: it makes the test's self-signed certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-days", "1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)  # fmt: skip
    return key, cert


def test_https_serves_with_the_given_certificate_and_refuses_plain_http(tmp_path, tiny_dir):
    key, cert = self_signed(tmp_path)
    port = free_port()
    cmd = [sys.executable, "-m", "kvfence", "serve", "--model", str(tiny_dir), "--port", str(port), "--dtype",
           "float32", "--threads", "1", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in NO_OPERATOR_ENV}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    verify = ssl.create_default_context(cafile=str(cert))
    try:
        with httpx.Client(base_url=f"https://127.0.0.1:{port}", verify=verify, timeout=10) as client:
            deadline = time.monotonic() + 120
            while True:  # poll until the server answers over TLS
                with contextlib.suppress(httpx.TransportError):
                    if client.get("/health").status_code == 200:
                        break
                with contextlib.suppress(httpx.TransportError):  # fail fast if the TLS flags were ignored
                    plain = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                    pytest.fail(f"plain HTTP answered {plain.status_code}: the server ignored its TLS flags")
                assert proc.poll() is None, "kvfence serve exited"
                assert time.monotonic() < deadline, "the HTTPS server did not come up"
                time.sleep(0.2)  # poll interval
            body = {"model": tiny_dir.name, "prompt": [5, 6], "max_tokens": 2}
            assert client.post("/v1/completions", json=body).status_code == 200
        with pytest.raises(httpx.TransportError):  # the port speaks TLS only
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        with pytest.raises(httpx.ConnectError):  # and only with a certificate the client trusts
            httpx.get(f"https://127.0.0.1:{port}/health", timeout=5)
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    assert f"https://127.0.0.1:{port}/v1" in out


def test_the_http_port_is_held_on_every_address_of_the_host():
    """`--host ""` (every interface) binds each address family the host has, on one port, listening: another
    socket cannot take the port even with SO_REUSEADDR (which lets sockets that are only bound share it)."""
    import socket

    from kvfence.runtime.http import bind_http

    held = bind_http("", 0)
    try:
        ports = {sock.getsockname()[1] for sock in held}
        assert len(ports) == 1 and {sock.family for sock in held} >= {socket.AF_INET}
        with socket.socket() as other:
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with pytest.raises(OSError):
                other.bind(("127.0.0.1", ports.pop()))
    finally:
        for sock in held:
            sock.close()
