"""The KV page map (issue 9): /debug/kv behind the admin key; the snapshot (pages, owners, transfers); the
/dashboard page in headless Chromium under load from two tenants, then an injected integrity failure showing
up in it; `kvfence top`; and the PD router aggregating its workers' maps (`kvfence serve --mode pd`).

Every wait is on a condition with a deadline: DOM conditions through WebDriverWait, /debug/kv conditions by
polling it. Screenshots go to $KVFENCE_ARTIFACTS (default tests/artifacts/, not in git).
"""

from __future__ import annotations

import io
import os
import random
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

import httpx
import numpy as np
import openai
import pytest
from rich.console import Console

from kvfence.dashboard.snapshot import (
    FREE,
    LEASED,
    RECEIVING,
    SEALED,
    STATES,
    KvMapper,
    PageAges,
    decode_pages,
)
from kvfence.dashboard.top import cmd_top
from kvfence.engine.preflight import preflight_config
from kvfence.engine.request import SamplingParams
from kvfence.faults import Faults
from kvfence.pd.local import layout_fingerprint
from kvfence.pd.messages import PageFrame, TransferId
from kvfence.pd.receiver import TransferReceiver
from kvfence.server.app import build_app
from kvfence.server.async_engine import AsyncEngine
from kvfence.server.auth import Authenticator, Operators
from kvfence.server.background import serve_in_thread
from kvfence.server.errors import OpenAIError
from kvfence.server.metrics import ServerMetrics
from kvfence.server.serving import ServerSettings
from tests.conftest import make_engine
from tests.pd_cluster import pd_serve
from tests.server_harness import MODEL, Handle

T = TypeVar("T")
KEYS = {"sk-team-a": "team-a", "sk-team-b": "team-b"}
ADMIN = "admin-7c41"
ADMIN_HEADER = {"Authorization": f"Bearer {ADMIN}"}
WAIT_S = 45.0
PROMPTS = {
    "sk-team-a": [
        "Quarterly revenue of the north region, draft for the board: ",
        "def forward(self, x): return ",
    ],
    "sk-team-b": [
        "Patient intake notes, ward three, confidential: ",
        "Les élèves étudient à l'école. Hello ",
    ],
}


# ---- fixtures -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_model) -> Iterator[Handle]:
    engine = make_engine(tiny_model, kv_pages=384, page_size=4, max_num_seqs=16, faults=Faults())
    report = preflight_config(tiny_model.config, engine.config)
    metrics = ServerMetrics()
    async_engine = AsyncEngine(engine, observer=metrics)
    settings = ServerSettings(MODEL, api_keys=KEYS, admin_key=ADMIN, preflight=report)
    with serve_in_thread(build_app(async_engine, settings, metrics)) as url:
        yield Handle(url, async_engine, metrics)


@pytest.fixture(scope="session")
def artifacts() -> Path:
    path = Path(os.environ.get("KVFENCE_ARTIFACTS") or Path(__file__).parent / "artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        message = "needs the Debian packages chromium and chromium-driver (`make test` installs them)"
        if os.environ.get("KVFENCE_REQUIRE_BROWSER"):
            pytest.fail(message)
        pytest.skip(message)
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1600,1000",
                "--force-device-scale-factor=1", "--lang=en-US"):  # fmt: skip
        options.add_argument(arg)
    if os.geteuid() == 0:
        options.add_argument("--no-sandbox")  # Chromium refuses to run as root with its sandbox
    chrome = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver))
    try:
        yield chrome
    finally:
        chrome.quit()


@contextmanager
def load(url: str, per_tenant: int = 3) -> Iterator[list[openai.APIError]]:
    """Streamed completions from both tenants, back to back, until the block ends. Yields the API errors the
    clients got (an injected fault's victim lands there)."""
    stop, errors = threading.Event(), []

    def run(key: str, seed: int) -> None:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=WAIT_S)
        rng = random.Random(seed)
        while not stop.is_set():
            prompt = rng.choice(PROMPTS[key]) + " ".join(
                rng.choice(["page", "lease", "tag"]) for _ in range(8)
            )
            try:
                stream = client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=160, temperature=0, stream=True,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                for _ in stream:
                    if stop.is_set():
                        break
                stream.close()
            except openai.APIError as e:
                errors.append(e)

    threads = [threading.Thread(target=run, args=(k, i)) for k in KEYS for i in range(per_tenant)]
    for t in threads:
        t.start()
    try:
        yield errors
    finally:
        stop.set()
        for t in threads:
            t.join(WAIT_S)


def debug_kv(url: str) -> dict[str, Any]:
    response = httpx.get(f"{url}/debug/kv", headers=ADMIN_HEADER, timeout=WAIT_S)
    assert response.status_code == 200, response.text
    return dict(response.json())


def wait_until(probe: Callable[[], T], ok: Callable[[T], bool], what: str) -> T:
    """Poll `probe` until `ok` holds (a few times a second, as the page does); fail after WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while not ok(value := probe()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        threading.Event().wait(0.2)  # the poll interval
    return value


def tenant_pages(snapshot: dict[str, Any]) -> dict[str, int]:
    """Pages leased (or being received) per tenant, over every worker of a /debug/kv answer."""
    pages: dict[str, int] = {}
    for w in snapshot["workers"]:
        arrays = decode_pages(w)
        held = arrays["request"][arrays["request"] >= 0]
        for index, n in zip(*np.unique(held, return_counts=True), strict=True):
            tenant = w["requests"][index]["tenant"]
            pages[tenant] = pages.get(tenant, 0) + int(n)
    return pages


def both_tenants(snapshot: dict[str, Any]) -> bool:
    return all(tenant_pages(snapshot).get(t, 0) > 0 for t in KEYS.values())


# ---- access ---------------------------------------------------------------------------------------------


def test_debug_kv_needs_the_admin_key(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.get(f"{server.url}/debug/kv", headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_admin_key"
    tenant = httpx.get(f"{server.url}/debug/kv", headers={"Authorization": "Bearer sk-team-a"})
    assert tenant.status_code == 403 and tenant.json()["error"]["code"] == "permission_denied"
    assert httpx.get(f"{server.url}/debug/kv", headers=ADMIN_HEADER).status_code == 200
    page = httpx.get(f"{server.url}/dashboard")  # the page holds no data: no key needed
    assert page.status_code == 200 and "default-src 'self'" in page.headers["content-security-policy"]
    assert "http" not in page.text.replace("http-equiv", "")  # nothing loads from elsewhere
    assert httpx.get(f"{server.url}/dashboard/dashboard.js").status_code == 200
    assert httpx.get(f"{server.url}/dashboard/../app.py").status_code == 404


def test_a_server_without_an_admin_key_shows_nobody():
    operators = Operators(None, None, Authenticator(KEYS))
    for key, status in ((ADMIN, 401), ("sk-team-a", 403)):
        with pytest.raises(OpenAIError) as exc:
            operators.check_admin(f"Bearer {key}", "/debug/kv")
        assert exc.value.status == status and "--admin-key" in exc.value.message


# ---- the snapshot ---------------------------------------------------------------------------------------


def test_snapshot_under_load_lists_pages_owners_and_tenants(server):
    with load(server.url):
        snapshot = wait_until(lambda: debug_kv(server.url), both_tenants, "leased pages of both tenants")
    (w,) = snapshot["workers"]
    assert snapshot["mode"] == "colocated" and w["role"] == "colocated"
    arrays = decode_pages(w)
    assert sum(w["counts"].values()) == w["num_pages"] == len(arrays["state"]) == 384
    held = (arrays["state"] == LEASED) | (arrays["state"] == SEALED) & (arrays["holders"] > 0)
    assert held.any() and (arrays["request"][held] >= 0).all() and (arrays["owner"][held] != 0).all()
    assert (arrays["holders"][arrays["state"] == LEASED] == 1).all()  # a leased page has one owner
    assert (arrays["owner"][arrays["state"] == FREE] == 0).all()
    for r in w["requests"]:
        assert r["tenant"] in KEYS.values() and r["phase"] in ("waiting", "prefill", "decode")
        assert r["preview"]  # the prompt's start, readable (admin only)
    assert w["preflight"]["verdict"] == "ok" and w["snapshot_ms"] < 1000
    server.assert_pool_clean()


def test_a_transfer_in_flight_is_receiving(tiny_model):
    engine = make_engine(tiny_model, kv_pages=32, page_size=4)
    cache = engine.runner.cache
    receiver = TransferReceiver(engine.pool, layout_fingerprint(engine), cache.page_bytes(), cache.write_page)
    prompt = list(range(5, 15))
    engine.expect_transfer(prompt, SamplingParams(max_tokens=4), "r1", tenant="team-b")
    ticket = receiver.reserve(TransferId(7), engine.live_requests()[0].request_id, 3)
    mapper = KvMapper(engine, "decode worker", "decode", receiver=receiver)
    first = mapper.snapshot()
    arrays = decode_pages(first)
    assert arrays["state"][list(ticket.page_ids)].tolist() == [RECEIVING] * 3
    assert arrays["request"][list(ticket.page_ids)].tolist() == [0] * 3
    assert first["requests"][0]["phase"] == "receiving KV" and first["requests"][0]["tenant"] == "team-b"
    assert first["transfers"] == [{"transfer_id": "0x7", "request_id": "r1", "received": 0, "expected": 3}]
    frame = PageFrame(
        ticket.transfer_id, 0, ticket.page_ids[0], ticket.lease_ids[0], bytes(cache.page_bytes())
    )
    receiver.on_frame(frame)
    assert mapper.snapshot()["transfers"][0]["received"] == 1
    assert mapper.snapshot()["counts"] == dict(zip(STATES, [29, 0, 0, 0, 3], strict=True))


def test_page_ages_restart_when_the_state_or_lease_changes():
    ages = PageAges(3)
    state, owner = np.array([0, 1, 1], np.uint8), np.array([0, 5, 6], np.uint64)
    assert ages.ages_ms(state, owner, 100.0).tolist() == [0, 0, 0]
    owner2 = np.array([0, 5, 9], np.uint64)  # page 2 went to a new lease
    assert ages.ages_ms(state, owner2, 102.5).tolist() == [2500, 2500, 0]


# ---- the page in a browser ------------------------------------------------------------------------------

SWATCH_PIXELS_JS = """
const swatch = document.querySelector(`#tenants li[data-tenant="${arguments[0]}"] .swatch`);
const want = getComputedStyle(swatch).backgroundColor.match(/\\d+/g).map(Number);
const canvas = document.querySelector("canvas[data-worker]");
const cell = Number(canvas.dataset.cell), cols = Number(canvas.dataset.cols), n = Number(canvas.dataset.pages);
const scale = canvas.width / (cols * cell);
const img = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
const hits = [];
for (let p = 0; p < n; p++) {
  const x = Math.floor(((p % cols) * cell + (cell - 1) / 2) * scale);
  const y = Math.floor((Math.floor(p / cols) * cell + (cell - 1) / 2) * scale);
  const i = (y * canvas.width + x) * 4;
  if ([0, 1, 2].every((k) => Math.abs(img[i + k] - want[k]) <= 2)) hits.push(p);
}
return hits;
"""


# The page redraws its panels on every poll, so an element found in one WebDriver call may be gone by the next:
# everything read from the page is read in one script, atomically with respect to its redraws.
LEGEND_JS = """const li = document.querySelector(`#tenants li[data-tenant="${arguments[0]}"]`);
return li ? Number(li.dataset.pages) : 0;"""
FAILURE_JS = """const row = document.querySelector("#failures tbody tr[data-request]");
return row && {request: row.dataset.request, cells: [...row.cells].map((td) => td.textContent)};"""


def legend_pages(driver: Any, tenant: str) -> int:
    return int(driver.execute_script(LEGEND_JS, tenant))


def read(driver: Any, selector: str, attribute: str) -> list[str]:
    """`attribute` of every element matching `selector`, in document order, read in one script."""
    script = "return [...document.querySelectorAll(arguments[0])].map((e) => e.getAttribute(arguments[1]));"
    return list(driver.execute_script(script, selector, attribute))


def test_dashboard_in_chromium_shows_tenants_then_an_integrity_failure(server, browser, artifacts):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, WAIT_S)
    browser.get(f"{server.url}/dashboard")  # no key yet: the page asks for one and shows nothing
    wait.until(lambda d: d.find_element(By.ID, "key-form").is_displayed())
    assert not browser.find_elements(By.CSS_SELECTOR, "canvas")
    with load(server.url) as errors:
        browser.get(f"{server.url}/dashboard#key={ADMIN}")
        wait.until(lambda d: all(legend_pages(d, t) > 0 for t in KEYS.values()))
        assert "#key" not in browser.current_url  # the key left the address bar
        for tenant in KEYS.values():  # the grid draws them: cells in the tenant's colour (redrawn each poll)
            wait.until(lambda d, t=tenant: d.execute_script(SWATCH_PIXELS_JS, t))
        wait.until(lambda d: _hover_shows_the_owner(d, ActionChains, By, "team-a"))
        browser.save_screenshot(str(artifacts / "dashboard-under-load.png"))
        heading = browser.find_element(By.TAG_NAME, "h1")
        ActionChains(browser).move_to_element(heading).perform()  # the tooltip off the grid

        server.between_steps(lambda: setattr(server.engine.engine.faults, "skip_stamp", 1))
        row = wait.until(lambda d: d.execute_script(FAILURE_JS))
        (failure,) = server.between_steps(lambda: list(server.engine.engine.recent_integrity_failures))
        assert row["request"] == failure["request_id"]
        expected = [
            failure["tenant"],
            str(failure["page"]),
            "I1 tag",
            failure["expected_tag"],
            failure["found_tag"],
        ]
        assert row["cells"][3:] == expected
        browser.save_screenshot(str(artifacts / "dashboard-integrity-failure.png"))
        wait_until(lambda: list(errors), bool, "the victim's error")
    assert {e.code for e in errors} == {"kv_integrity_error"}
    server.assert_pool_clean()


def _hover_shows_the_owner(browser: Any, chains: Any, by: Any, tenant: str) -> bool:
    """Hover a cell drawn in `tenant`'s colour; True once the tooltip names that page, its lease and tenant
    (the page may change owner between the pixel read and the hover: the caller waits until it holds)."""
    pages = browser.execute_script(SWATCH_PIXELS_JS, tenant)
    if not pages:
        return False
    canvas = browser.find_element(by.CSS_SELECTOR, "canvas[data-worker]")  # one per worker, kept across polls
    cell, cols = (int(read(browser, "canvas[data-worker]", a)[0]) for a in ("data-cell", "data-cols"))
    x = (pages[0] % cols) * cell + cell // 2 - canvas.size["width"] // 2
    y = (pages[0] // cols) * cell + cell // 2 - canvas.size["height"] // 2
    chains(browser).move_to_element_with_offset(canvas, x, y).perform()
    tip = browser.find_element(by.ID, "tooltip")
    text = tip.text if tip.is_displayed() else ""
    return text.startswith(f"page {pages[0]} ") and "lease id  0x" in text and f"tenant    {tenant}" in text


# ---- the terminal view ----------------------------------------------------------------------------------


def test_top_prints_the_map_for_a_headless_host(server, capsys):
    console = Console(file=io.StringIO(), width=150, force_terminal=False)
    with load(server.url):
        wait_until(lambda: debug_kv(server.url), both_tenants, "leased pages of both tenants")
        args = SimpleNamespace(url=server.url, admin_key=ADMIN, once=True, interval=1.0)
        assert cmd_top(args, console) == 0
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert "colocated (colocated) · preflight ok" in out and "384 pages" in out
    assert "team-a" in out and "team-b" in out and "Integrity failures" in out
    for key in ("nope", "sk-team-a"):  # unknown (401), and a tenant's (403): both refused, said so
        wrong = SimpleNamespace(url=server.url, admin_key=key, once=True, interval=1.0)
        assert cmd_top(wrong, Console(file=io.StringIO())) == 1
        assert "the admin key was refused" in capsys.readouterr().err


# ---- PD: the router aggregates its workers ---------------------------------------------------------------


@pytest.fixture(scope="module")
def pd_url(tiny_dir, tmp_path_factory) -> Iterator[str]:
    keys = tmp_path_factory.mktemp("keys") / "keys.toml"
    keys.write_text("".join(f'"{k}" = "{t}"\n' for k, t in KEYS.items()))
    flags = ["--served-model-name", MODEL, "--page-size", "4", "--prefill-kv-pages", "96", "--decode-kv-pages",
             "192", "--admin-key", ADMIN]  # fmt: skip
    with pd_serve(tiny_dir, keys, *flags, env={"KVFENCE_ADMIN_KEY": ""}) as url:
        yield url


def test_pd_router_aggregates_every_workers_map(pd_url):
    assert httpx.get(f"{pd_url}/debug/kv").status_code == 401
    assert httpx.get(f"{pd_url}/debug/kv", headers={"Authorization": "Bearer sk-team-b"}).status_code == 403
    assert httpx.get(f"{pd_url}/dashboard").status_code == 200
    with load(pd_url, per_tenant=2):
        snapshot = wait_until(
            lambda: debug_kv(pd_url),
            lambda s: both_tenants(s) and not s["errors"],
            "both tenants on the workers",
        )
    assert snapshot["mode"] == "pd"
    workers = {w["role"]: w for w in snapshot["workers"]}
    assert sorted(workers) == ["decode", "prefill"]
    assert [workers[r]["num_pages"] for r in ("prefill", "decode")] == [96, 192]
    for w in workers.values():
        assert w["preflight"]["verdict"] == "ok" and w["pid"] and w["name"].startswith(w["role"])
        assert sum(w["counts"].values()) == w["num_pages"]
    done = wait_until(
        lambda: debug_kv(pd_url), lambda s: _decode(s)["receiver"]["completed"] > 0, "a transfer"
    )
    assert _decode(done)["receiver"]["failed"] == {}


def _decode(snapshot: dict[str, Any]) -> dict[str, Any]:
    return next(w for w in snapshot["workers"] if w["role"] == "decode")


def test_pd_dashboard_draws_each_worker(pd_url, browser, artifacts):
    from selenium.webdriver.support.ui import WebDriverWait

    with load(pd_url, per_tenant=2):
        browser.get(f"{pd_url}/dashboard#key={ADMIN}")
        wait = WebDriverWait(browser, WAIT_S)
        wait.until(lambda d: all(legend_pages(d, t) > 0 for t in KEYS.values()))
        assert sorted(int(n) for n in read(browser, "canvas[data-worker]", "data-pages")) == [96, 192]
        assert read(browser, "#preflight tbody tr[data-verdict]", "data-verdict") == ["ok", "ok"]
        browser.save_screenshot(str(artifacts / "dashboard-pd.png"))
