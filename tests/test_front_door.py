"""Who may read what at the HTTP front door (docs/security.md): `/metrics` and `/debug/*` need an operator
credential (the admin key; the scrape key opens `/metrics` only), never a tenant's API key; a tenant reads its own
usage only. HTTPS with --ssl-keyfile / --ssl-certfile."""

from __future__ import annotations

import contextlib
import shutil
import ssl
import subprocess
import sys
import time

import httpx
import pytest

from tests.pd_cluster import free_port
from tests.server_harness import MODEL, SCRAPE_KEY, running_server

KEYS = {"key-alice": "alice", "key-bob": "bob"}
ADMIN = "admin-key"
CREDENTIALS = {"none": None, "unknown": "nobody", "tenant": "key-bob", "scrape": SCRAPE_KEY, "admin": ADMIN}
EXPECTED = {  # route -> status per credential, in CREDENTIALS' order
    "/metrics": (401, 401, 403, 200, 200),
    "/debug/kv": (401, 401, 403, 403, 200),
    "/debug/config": (401, 401, 403, 403, 200),
    "/v1/usage": (401, 401, 200, 401, 401),
}


@pytest.fixture(scope="module")
def server(tiny_model):
    with running_server(tiny_model, api_keys=KEYS, admin_key=ADMIN, metrics_key=SCRAPE_KEY) as srv:
        yield srv


def get(srv, route: str, key: str | None) -> httpx.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.get(f"{srv.url}{route}", headers=headers, timeout=30)


@pytest.mark.parametrize("route", sorted(EXPECTED))
def test_each_route_opens_to_its_credentials_only(server, route):
    got = tuple(get(server, route, key).status_code for key in CREDENTIALS.values())
    assert dict(zip(CREDENTIALS, got, strict=True)) == dict(zip(CREDENTIALS, EXPECTED[route], strict=True))


def test_a_tenant_sees_its_own_usage_and_nothing_of_another_tenants(server):
    for key, prompt in (("key-alice", [5, 6, 7, 8]), ("key-alice", [9, 10]), ("key-bob", [11])):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
        r = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
    deadline = time.monotonic() + 30
    while (bob := get(server, "/v1/usage", "key-bob").json())[
        "requests"
    ] < 1:  # ends are counted after replies
        assert time.monotonic() < deadline
        time.sleep(0.02)  # poll interval
    alice = get(server, "/v1/usage", "key-alice").json()
    assert bob == {
        "object": "usage",
        "tenant": "bob",
        "requests": 1,
        "prompt_tokens": 1,
        "completion_tokens": 2,
    }
    assert alice["tenant"] == "alice" and alice["prompt_tokens"] == 6
    assert "alice" not in get(server, "/v1/usage", "key-bob").text
    tenant_view = get(server, "/metrics", "key-bob")
    assert tenant_view.status_code == 403 and "alice" not in tenant_view.text


def test_without_an_operator_key_a_server_with_tenants_shows_metrics_to_nobody(tiny_model):
    with running_server(tiny_model, api_keys=KEYS, metrics_key=None) as srv:
        r = get(srv, "/metrics", "key-alice")
        assert r.status_code == 403 and "--metrics-key" in r.json()["error"]["message"]


def kvfence(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvfence", *args], capture_output=True, text=True, timeout=120
    )


def test_an_operator_key_that_is_a_tenants_key_or_bad_tls_files_stop_the_start(tmp_path, tiny_dir):
    keys = tmp_path / "keys.json"
    keys.write_text('{"key-alice": "alice"}')
    for flags, problem in (
        (["--admin-key", "key-alice"], "also the API key of tenant 'alice'"),
        (["--metrics-key", "key-alice"], "also the API key of tenant 'alice'"),
        (["--ssl-keyfile", str(tmp_path / "nope.pem")], "go together"),
        (
            ["--ssl-keyfile", str(tmp_path / "k.pem"), "--ssl-certfile", str(tmp_path / "c.pem")],
            "no such file",
        ),
    ):
        for command in (["serve"], ["router", "--insecure-cluster"]):
            done = kvfence(*command, "--model", str(tiny_dir), "--api-keys", str(keys), *flags)
            assert done.returncode == 2 and problem in done.stderr, (command, flags, done.stderr[-500:])


def test_https_serves_with_the_given_certificate_and_refuses_plain_http(tmp_path, tiny_dir):
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is missing")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-days", "1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)  # fmt: skip
    port = free_port()
    cmd = [sys.executable, "-m", "kvfence", "serve", "--model", str(tiny_dir), "--port", str(port), "--dtype",
           "float32", "--threads", "1", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with httpx.Client(
            base_url=f"https://127.0.0.1:{port}",
            verify=ssl.create_default_context(cafile=str(cert)),
            timeout=10,
        ) as client:
            deadline = time.monotonic() + 120
            while True:
                with contextlib.suppress(httpx.TransportError):
                    if client.get("/health").status_code == 200:
                        break
                assert proc.poll() is None and time.monotonic() < deadline, "the HTTPS server did not come up"
                time.sleep(0.2)  # poll interval
            body = {"model": tiny_dir.name, "prompt": [5, 6], "max_tokens": 2}
            assert client.post("/v1/completions", json=body).status_code == 200
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    assert f"https://127.0.0.1:{port}/v1" in out
