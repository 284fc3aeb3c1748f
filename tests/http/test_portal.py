"""The web portal (issue 25): its routes, and the page itself in headless Chromium against a real server.

The browser is Debian's chromium (``apt-get install chromium``; the README's test command installs
it), driven by playwright: playwright's own browser download needs hosts this machine cannot reach.
A missing browser fails these tests; it never skips them. ``SPARK_TEST_CHROMIUM`` names another binary.

The server has two recipes (and a refused one): ``tiny`` (random weights of a tiny shape, loaded at start) and ``smol``
(the embedded default model). The page switches to ``smol``, chats with it, and its usage chart is
read against ``/api/inference/usage``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time

import pytest
import torch
from playwright.sync_api import Page, expect, sync_playwright

from spark.control.activity import key_id
from spark.http import create_app
from spark.serve_config import ServeConfig
from tests.control.serving import running_server

KEY = "sk-portal-client-0123456789"
ADMIN = "sk-portal-admin-9876543210"
RECIPES = {
    "tiny": "served_name: tiny\nengine: spark\nmodel: dummy\ndummy:\n  preset: tiny-llama\n"
            "  config: {max_position_embeddings: 4096}\n",
    "smol": "served_name: smol\nengine: spark\nmodel: default\nroi_profile: cloud-small\n",
}
ROI_PROFILES = "profiles:\n  cloud-small: {name: Cloud Small, provider: acme, model: small-1}\n"
PRICES = {"cloud-small": {"in": 1.5, "out": 6.0}}  # USD per million tokens
# As root in a container with no network: no sandbox, no GPU, nothing fetched in the background.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                 "--disable-background-networking", "--disable-component-update"]
SWITCH_TIMEOUT_MS = 120_000


# -- the routes, without a server -------------------------------------------------------------------


async def test_the_page_and_its_files_need_no_key():
    client = create_app(ServeConfig(model="dummy:unused", api_keys=("k",), admin_key="a")).test_client()
    page = await client.get("/")
    html = (await page.get_data()).decode()
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["Content-Security-Policy"]
    assert '<script src="/portal/portal.js"' in html and 'href="/portal/portal.css"' in html
    for name, kind in (("portal.js", "text/javascript"), ("portal.css", "text/css")):
        r = await client.get(f"/portal/{name}")
        assert r.status_code == 200 and r.headers["Content-Type"].startswith(kind) and await r.get_data()
    for other in ("/portal", "/ui"):
        r = await client.get(other)
        assert r.status_code == 302 and r.headers["Location"] == "/"
    missing = await client.get("/portal/index.htm")
    assert missing.status_code == 404 and (await missing.get_json())["error"]["code"] == "not_found"
    assert (await client.get("/portal/..%2Fportal.py")).status_code == 404


# -- the page, in a browser --------------------------------------------------------------------------


def _chromium() -> str:
    path = os.environ.get("SPARK_TEST_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("no chromium: the portal's browser test needs Debian's chromium "
                    "(`apt-get install -y chromium`, as the README's test command does)")
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("portal")
    recipes = root / "recipes"
    recipes.mkdir()
    for name, body in RECIPES.items():
        (recipes / f"{name}.yaml").write_text(f"id: {name}\n{body}")
    (recipes / "roi-profiles.yaml").write_text(ROI_PROFILES)
    (recipes / "broken.yaml").write_text("id: broken\nserved_name: broken\nmodel: default\nno_such_field: 1\n")
    (root / "config").mkdir()
    (root / "config" / "inference-pricing.json").write_text(json.dumps(PRICES))
    config = ServeConfig(config_dir=str(root / "config"), recipes_dir=str(recipes), recipe="tiny", device="cpu", max_model_len=512,
                         kv_cache_bytes=64 << 20, max_batch_size=8, api_keys=(KEY,), admin_key=ADMIN,
                         switch_grace_s=5.0, activity_log_path=str(root / "activity.jsonl"),
                         usage_path=str(root / "usage.json"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the engine shares 2 cores with the browser
    try:
        with running_server(config) as running:
            yield running
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=_chromium(), args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(browser, server):
    context = browser.new_context(viewport={"width": 1280, "height": 1600})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(server.url + "/portal")  # redirected to /
    assert page.url == server.url + "/"
    yield page
    context.close()
    assert errors == [], errors


def _usage_in_chart(page: Page) -> dict:
    """Every bar of the usage chart: (recipe, window) -> what its data and its label say."""
    bars = page.locator("#usage-chart g.bar").evaluate_all(
        """gs => gs.map(g => ({recipe: g.dataset.recipe, window: g.dataset.window,
                               requests: +g.dataset.requests, prompt_tokens: +g.dataset.promptTokens,
                               completion_tokens: +g.dataset.completionTokens,
                               label: g.querySelector('text.value').textContent}))""")
    out = {}
    for bar in bars:
        tokens, requests = re.fullmatch(r"([\d,]+) tok · ([\d,]+) req", bar["label"]).groups()
        assert int(tokens.replace(",", "")) == bar["prompt_tokens"] + bar["completion_tokens"], bar
        assert int(requests.replace(",", "")) == bar["requests"], bar
        out[bar["recipe"], bar["window"]] = {k: bar[k] for k in ("requests", "prompt_tokens", "completion_tokens")}
    return out


def _usage_from_api(server) -> tuple[dict, dict]:
    """(recipe, window) -> counts, and the ROI profiles' costs: what /api/inference/usage says."""
    with server.http(ADMIN) as http:
        usage = http.get("/api/inference/usage").json()
    counts = {(recipe, window): c for recipe, windows in usage["recipes"].items() for window, c in windows.items()}
    return counts, usage["roi"]["profiles"]


def test_switch_chat_and_usage_through_the_page(server, page):
    with server.http(KEY) as http:  # a first request on the start-up recipe, for a second row in the chart
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "Once", "max_tokens": 3})
        assert r.status_code == 200, r.text
    page.fill("#api-key", KEY)
    expect(page.locator("#active-profile")).to_have_text("tiny")
    expect(page.locator("#slot-state")).to_have_text("active")
    expect(page.locator("#health")).to_have_text("healthy")
    expect(page.locator("#recipes tr[data-recipe=smol] .badge")).to_have_text("available")
    expect(page.locator("#switch-progress")).to_be_hidden()
    expect(page.locator("#recipe-problems li")).to_contain_text(["no_such_field"])  # a recipe that was refused

    page.select_option("#switch-recipe", "smol")
    page.click("#switch-button")  # the API key may read, not switch
    expect(page.locator("#profile-error")).to_contain_text("admin key")
    assert server.slot.active.id == "tiny"

    page.fill("#admin-key", ADMIN)
    page.click("#switch-button")
    expect(page.locator("#switch-progress")).to_have_attribute("data-state", "ready", timeout=SWITCH_TIMEOUT_MS)
    expect(page.locator("#switch-text")).to_contain_text("smol is ready")
    expect(page.locator("#active-profile")).to_have_text("smol")
    expect(page.locator("#profile-error")).to_have_text("")
    assert server.slot.active.id == "smol" and server.slot.state == "active"
    expect(page.locator("#log-tail")).to_contain_text(re.compile(r"active +smol: up in"))

    page.fill("#chat-max-tokens", "12")
    page.fill("#chat-temperature", "0")
    page.fill("#chat-input", "What is the capital of France?")
    page.press("#chat-input", "Enter")
    reply = page.locator(".msg.assistant").last
    expect(reply).to_have_attribute("data-state", "done", timeout=60_000)
    text = reply.locator(".content").inner_text()
    assert text.strip(), "no reply"
    assert int(reply.get_attribute("data-chunks")) >= 2  # it came as a stream, piece by piece
    expect(reply.locator(".meta")).to_contain_text(re.compile(r"smol · finish: \w+ .*prompt \+ \d+ completion tokens"))
    expect(page.locator("#activity-table tbody tr").first).to_contain_text("/v1/chat/completions")

    deadline = time.monotonic() + 30
    while True:  # the page polls; the request is counted once its stream has ended
        chart, (api, roi) = _usage_in_chart(page), _usage_from_api(server)
        if chart == api and api.get(("smol", "total"), {}).get("requests"):
            break
        assert time.monotonic() < deadline, (chart, api)
        time.sleep(0.5)
    costs = page.locator("#roi-table tr[data-profile=cloud-small] td[data-window]").evaluate_all(
        "tds => Object.fromEntries(tds.map(td => [td.dataset.window, [+td.dataset.usd, td.textContent]]))")
    total = (api["smol", "total"]["prompt_tokens"] * 1.5 + api["smol", "total"]["completion_tokens"] * 6.0) / 1e6
    assert roi["cloud-small"]["total"] == pytest.approx(total, abs=1e-6)  # the API rounds to 1e-6 USD
    assert costs["total"][0] == roi["cloud-small"]["total"] and costs["hour"][0] == roi["cloud-small"]["hour"]
    assert float(costs["total"][1].removeprefix("$")) == pytest.approx(roi["cloud-small"]["total"], rel=0.05)
    assert chart[("smol", "hour")]["requests"] == chart[("smol", "total")]["requests"] == 1
    assert chart[("tiny", "day")]["requests"] == 1 and chart[("tiny", "day")]["prompt_tokens"] > 0
    with server.http(ADMIN) as http:  # logged before the usage counted it
        clients = http.get("/api/inference/activity").json()["day"]["clients"]
    assert list(clients) == [key_id(KEY)] and clients[key_id(KEY)]["requests"] == 2  # tiny's, then the page's
    expect(page.locator(f"#clients-table tr[data-client={key_id(KEY)}] td")).to_have_text(
        [key_id(KEY), "2", "2", "0", re.compile(r"\d+"), re.compile(r"\d+")], timeout=15_000)
    rows = page.locator("#usage-table tbody tr[data-recipe=smol][data-window=total] td").all_inner_texts()
    assert rows == ["smol", "total", "1", str(api["smol", "total"]["prompt_tokens"]),
                    str(api["smol", "total"]["completion_tokens"])]


def _sse(*chunks: dict) -> str:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def test_reasoning_and_tool_calls_are_drawn_apart(page):
    """The page's stream reader, on a canned stream in OpenAI's shape (what a thinking, calling model sends)."""
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m"}

    def chunk(delta: dict, finish: str | None = None) -> dict:
        return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    body = _sse(chunk({"role": "assistant", "content": ""}),
                chunk({"reasoning_content": "The user wants "}), chunk({"reasoning_content": "the weather."}),
                chunk({"content": "Let me look."}),
                chunk({"tool_calls": [call]}),
                chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
                chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
                chunk({}, "tool_calls"),
                {**head, "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16}})
    sent = []

    def answer(route):
        sent.append(json.loads(route.request.post_data))
        route.fulfill(status=200, body=body, headers={"Content-Type": "text/event-stream"})

    page.route("**/v1/chat/completions", answer)
    page.click("#chat-options summary")
    page.fill("#chat-tools", json.dumps([{"type": "function", "function": {"name": "get_weather"}}]))
    page.fill("#chat-input", "Weather in Paris?")
    page.click("#chat-send")
    reply = page.locator(".msg.assistant").last
    expect(reply).to_have_attribute("data-state", "done")
    expect(reply.locator(".reasoning .text")).to_have_text("The user wants the weather.")
    expect(reply.locator(".content")).to_have_text("Let me look.")
    expect(reply.locator(".tool-call .name")).to_have_text("get_weather()")
    assert json.loads(reply.locator(".tool-call pre").inner_text()) == {"city": "Paris"}
    expect(reply.locator(".meta")).to_contain_text("finish: tool_calls")
    expect(reply.locator(".meta")).to_contain_text("9 prompt + 7 completion tokens")
    assert sent[0]["stream"] is True and sent[0]["tools"][0]["function"]["name"] == "get_weather"
    assert sent[0]["messages"] == [{"role": "user", "content": "Weather in Paris?"}]

    reply.locator("input.tool-result").fill('{"celsius": 21}')  # the next turn carries the call and its result
    page.click("#chat-send")  # with no text: the result alone goes back
    expect(page.locator(".msg.assistant[data-state=done]")).to_have_count(2)
    expect(page.locator(".msg.tool .content")).to_have_text('call_1: {"celsius": 21}')
    assert sent[1]["messages"][1:] == [
        {"role": "assistant", "content": "Let me look.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'}]
