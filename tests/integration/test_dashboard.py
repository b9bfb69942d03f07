"""The dashboard in headless Chromium (Debian's, driven by Playwright), against the real processes: clicking as an
operator would, watching the pages change without a reload, and a viewer who may only look.

Screenshots of every page at 1280x800 go to the test run's temporary directory (printed with `pytest -s`)."""

from __future__ import annotations

import os
import re
import shutil

import openai
import pytest

from tests.integration.harness import wait_for

pytestmark = pytest.mark.integration

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]
PAGES = ("overview", "nodes", "models", "replicas", "profiles", "engines", "mirror", "keys", "users", "events",
         "settings")
MODEL = "dash-m"


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        yield chromium
        chromium.close()


class Watched:
    """A logged-in page that records console errors, failed requests and error responses."""

    def __init__(self, browser, system, user: str, password: str):
        self.base = system.url
        self.context = browser.new_context(viewport={"width": 1280, "height": 800}, base_url=system.url)
        self.context.set_default_timeout(30_000)
        self.page = self.context.new_page()
        self.problems: list[str] = []
        self.page.on("console", lambda m: self._console(m))
        self.page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        self.page.on("requestfailed", lambda r: self._failed(r))
        self.page.on("response", lambda r: self._response(r))
        self.page.on("dialog", lambda d: d.accept())  # every confirmation: yes
        self.page.goto("/login/")
        self.page.fill("#id_username", user)
        self.page.fill("#id_password", password)
        self.page.click("button[type=submit]")
        self.page.wait_for_url(system.url + "/")
        self.page.wait_for_selector("#live-state.on")  # the websocket is open

    def _console(self, message) -> None:
        if message.type == "error":
            self.problems.append(f"console: {message.text}")

    def _response(self, response) -> None:
        if response.status >= 400:
            self.problems.append(f"{response.status} {response.request.method} {response.url}")

    def _failed(self, request) -> None:
        # a partial refetch cut short by the next navigation is not a failure of the page
        if request.failure != "net::ERR_ABORTED":
            self.problems.append(f"failed: {request.method} {request.url} {request.failure}")

    def go(self, page: str) -> None:
        self.page.click(f"nav a[data-page={page}]")
        self.page.wait_for_url(self.base + ("/" if page == "overview" else f"/{page}/"))
        self.page.wait_for_selector("#live-state.on")
        self.page.evaluate("window.__notReloaded = true")  # gone if the page reloads

    def still_same_page(self) -> bool:
        return self.page.evaluate("window.__notReloaded === true")

    def message(self) -> str:
        return self.page.locator("#messages").inner_text()


@pytest.fixture(scope="module")
def dash(system, browser):
    system.cli("user", "add", "dash-viewer", "--role", "viewer", "--password", "viewer-password")
    admin = Watched(browser, system, "admin", "admin-password")
    yield admin
    admin.context.close()
    system.cli("ctl", "model", "remove", MODEL, check=False)
    wait_for(lambda: MODEL not in [m["name"] for m in system.cli_json("ctl", "models")], 60, what=f"{MODEL} removed")


def card(dash, model: str = MODEL):
    return dash.page.locator(f"section[data-model={model}]")


def test_add_a_model_and_watch_its_replicas_become_ready_without_reloading(system, dash):
    dash.go("models")
    form = dash.page.locator("#model-add")
    form.locator("input[name=name]").fill(MODEL)
    form.locator("select[name=file]").select_option(system.sha)
    form.locator("select[name=engine]").select_option("testengine")
    form.locator("input[name=replicas]").fill("2")
    form.locator("input[name=memory]").fill("300MiB")
    form.locator("button").click()
    dash.page.wait_for_selector(f"text=model {MODEL} added")
    card(dash).locator(".count", has_text="2/2 ready").wait_for(timeout=60_000)
    assert card(dash).locator("[data-testid=state]", has_text="ready").count() == 2
    assert dash.page.locator("#model-add").count() == 1  # the live updates swapped the cards, not the form
    assert dash.page.locator("#live").count() == 1
    assert dash.still_same_page()


def test_restart_model_goes_queued_replacing_done_without_reloading(system, dash):
    dash.go("models")
    before = set(card(dash).locator("tr[data-replica]").evaluate_all("rows => rows.map(r => r.dataset.replica)"))
    assert len(before) == 2
    # every restart marker the page ever shows, as the live updates swap the card
    dash.page.evaluate("""() => {
        window.__markers = new Set();
        const seen = () => document.querySelectorAll('[data-testid=restart]')
            .forEach(e => window.__markers.add(e.textContent.trim()));
        new MutationObserver(seen).observe(document.body, {subtree: true, childList: true, characterData: true});
    }""")
    card(dash).locator("button", has_text="Restart model").click()
    dash.page.wait_for_selector("text=2 replica(s) queued for restart")

    def replaced():
        names = set(card(dash).locator("tr[data-replica]").evaluate_all("rows => rows.map(r => r.dataset.replica)"))
        ready = card(dash).locator("[data-testid=state]", has_text="ready").count()
        return names and not names & before and ready == 2 and card(dash).locator("[data-testid=restart]").count() == 0

    wait_for(replaced, 120, interval=0.3, what="both replicas replaced, as the page shows")
    markers = set(dash.page.evaluate("[...window.__markers]"))
    assert {"restart queued", "restart replacing"} <= markers, markers
    assert dash.still_same_page()


def test_set_a_models_queue_limit_from_its_edit_form(system, dash):
    dash.go("models")
    edit = card(dash).locator(f"#edit-{MODEL}")
    edit.locator("summary").click()
    edit.locator("input[name=queue_limit]").fill("7")
    edit.locator("input[name=max_wait]").fill("45s")
    edit.locator("button", has_text="Save").click()
    dash.page.wait_for_selector(f"text=model {MODEL} changed")
    card(dash).locator(".queue", has_text="at most 7 waiting, each at most 45s").wait_for()
    shown = {m["name"]: m for m in system.cli_json("ctl", "models")}[MODEL]
    assert (shown["queue_limit"], shown["max_wait_seconds"]) == (7, 45)
    assert (shown["queue"]["queue_limit"], shown["queue"]["waiting"]) == (7, 0)
    assert dash.still_same_page()


def test_drain_and_undrain_a_node(system, dash):
    dash.go("nodes")
    row = dash.page.locator("tr[data-node=n3]")
    row.locator("button", has_text="Drain").click()
    row.locator("[data-testid=drain]", has_text="drained").wait_for(timeout=90_000)
    assert {n["name"]: n for n in system.cli_json("ctl", "nodes")}["n3"]["drain"] == "drained"
    row.locator("button", has_text="Undrain").click()
    row.locator("[data-testid=drain]", has_text="schedulable").wait_for()
    assert not {n["name"]: n for n in system.cli_json("ctl", "nodes")}["n3"]["draining"]
    assert dash.still_same_page()


def test_a_node_gets_a_new_token_by_a_click(system, dash):
    system.cli("node", "add", "dash-tok")
    try:
        dash.go("nodes")
        dash.page.locator("tr[data-node=dash-tok]").locator("button", has_text="New token").click()
        command = dash.page.locator("#once-value").inner_text().strip()
        assert re.fullmatch(r"LLMGW_AGENT_TOKEN=lnt_\S+ llmgw agent --server \S+", command), command
        said = system.cli_json("ctl", "events", "--kind", "node.token_reset", "--subject", "dash-tok")
        assert [e["actor"] for e in said] == ["user:admin"], said
        assert dash.still_same_page()
    finally:
        system.cli("node", "remove", "dash-tok", check=False)


def test_a_command_engine_is_added_and_says_what_it_serves_by_clicks(system, dash):
    dash.go("engines")
    form = dash.page.locator("form[hx-post$='/engines/add/']")
    form.locator("input[name=name]").fill("dash-ranker")
    form.locator("select[name=kind]").select_option("command")
    form.locator("input[name=command]").fill("{python} ranker.py --port {port}")
    for capability in ("rerank", "embeddings"):
        form.locator(f"input[name=serves][value={capability}]").check()
    form.locator("button", has_text="Add engine").click()
    dash.page.wait_for_selector("text=engine dash-ranker added")
    row = dash.page.locator("tr[data-engine=dash-ranker]")
    row.locator("td", has_text="embeddings, rerank").wait_for()
    for capability in ("rerank", "embeddings"):
        form.locator(f"input[name=serves][value={capability}]").uncheck()
    form.locator("input[name=serves][value=chat]").check()
    form.locator("button", has_text="Change what it serves").click()
    dash.page.wait_for_selector("text=engine dash-ranker serves chat")
    row.locator("td", has_text="chat").wait_for()
    (engine,) = [e for e in system.cli_json("ctl", "engines") if e["name"] == "dash-ranker"]
    assert engine["serves"] == ["chat"]
    assert dash.still_same_page()


def test_create_a_key_see_it_once_and_use_it(system, dash):
    dash.go("keys")
    dash.page.fill("input[name=name]", "dash-key")
    dash.page.click("text=Create key")
    secret = dash.page.locator("#once-value").inner_text().strip()
    assert "copy it now" in dash.message()
    client = openai.OpenAI(base_url=system.url + "/v1", api_key=secret, max_retries=0, timeout=60)
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].message.content
    dash.go("keys")
    assert secret not in dash.page.content()  # shown once
    assert dash.page.locator("tr[data-key=dash-key]").count() == 1


def test_create_a_batch_key_and_make_it_interactive_by_clicks(system, dash):
    dash.go("keys")
    create = dash.page.locator("#key-create-form")
    create.locator("input[name=name]").fill("dash-prio")
    create.locator("select[name=priority]").select_option("batch")
    create.locator("input[name=log_bodies]").check()
    create.locator("button", has_text="Create key").click()
    dash.page.locator("#once-value").wait_for()
    dash.page.locator("tr[data-key=dash-prio] td.priority", has_text="batch").wait_for()
    assert dash.page.locator("tr[data-key=dash-prio] td.bodies").inner_text().strip() == "logged"
    change = dash.page.locator("#key-set-form")
    change.locator("input[name=name]").fill("dash-prio")
    change.locator("select[name=priority]").select_option("interactive")
    change.locator("input[name=rpm]").fill("120")
    change.locator("input[name=budget]").fill("2M/day")
    change.locator("input[name=max_concurrency]").fill("3")
    change.locator("select[name=log_bodies]").select_option("no")
    change.locator("button", has_text="Change key").click()
    dash.page.locator("tr[data-key=dash-prio] td.priority", has_text="interactive").wait_for()
    assert "key dash-prio changed" in dash.message()
    budget = dash.page.locator("tr[data-key=dash-prio] td.budget")
    assert re.fullmatch(r"0 of 2M this day, resets \d{4}-\d\d-\d\d 00:00 UTC", budget.inner_text().strip())
    assert dash.page.locator("tr[data-key=dash-prio] td.concurrency").inner_text().strip() == "3"
    (key,) = [k for k in system.cli_json("ctl", "keys", "list") if k["name"] == "dash-prio"]
    assert (key["priority"], key["rpm"], key["state"], key["max_concurrency"]) == ("interactive", 120, "active", 3)
    assert key["log_bodies"] is False and dash.page.locator("tr[data-key=dash-prio] td.bodies").inner_text() == "—"
    assert (key["budget"]["tokens"], key["budget"]["period"], key["budget"]["spent"]) == (2_000_000, "day", 0)
    assert dash.still_same_page()


def test_stop_then_start_from_the_overview(system, dash):
    secret = system.cli("ctl", "keys", "create", "dash-stop").stdout.split()[-1]
    client = openai.OpenAI(base_url=system.url + "/v1", api_key=secret, max_retries=0, timeout=60)
    dash.go("overview")
    dash.page.click("button:has-text('Stop')")
    dash.page.locator("[data-testid=serving]", has_text="Stopped").wait_for()
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert refused.value.status_code == 503 and refused.value.body["code"] == "system_stopped"
    dash.page.click("button:has-text('Start')")
    dash.page.locator("[data-testid=serving]", has_text="Serving").wait_for()
    system.wait_ready(MODEL, 2, timeout=90)
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].message.content


def test_upload_a_model_file_with_a_progress_bar(system, dash, tmp_path):
    path = tmp_path / "upload.bin"
    path.write_bytes(os.urandom(16 * 1024**2))
    dash.go("mirror")
    dash.page.evaluate("""() => { window.__progress = [];
        document.body.addEventListener('htmx:xhr:progress', e => window.__progress.push(e.detail.loaded)); }""")
    dash.page.set_input_files("#upload input[type=file]", str(path))
    dash.page.click("#upload button")
    dash.page.wait_for_selector("text=upload.bin uploaded: sha256", timeout=60_000)
    assert dash.page.evaluate("window.__progress.length") >= 1
    files = system.api("GET", "/api/v1/model-files/").json()["results"]
    assert any(f["name"] == "upload.bin" and f["size"] == 16 * 1024**2 for f in files)
    assert dash.page.locator("tr", has_text="upload.bin").count() == 1  # the table updated in place


def test_a_viewer_sees_no_stop_button_and_a_forged_post_is_refused(system, browser):
    viewer = Watched(browser, system, "dash-viewer", "viewer-password")
    try:
        for page in ("overview", "nodes", "models", "replicas", "keys", "settings"):
            viewer.go(page)
            assert viewer.page.locator("main button").count() == 0, page
        token = next(c["value"] for c in viewer.context.cookies() if c["name"] == "csrftoken")
        forged = viewer.page.request.post(system.url + "/system/stop/", headers={
            "X-CSRFToken": token, "HX-Request": "true", "Origin": system.url})
        assert forged.status == 403 and "needs the operator or admin role" in forged.text()
        assert "serving" in system.cli("status").stdout.lower() and "STOPPED" not in system.cli("status").stdout
    finally:
        viewer.context.close()


def test_every_page_loads_with_no_console_error_or_failed_request(system, dash, tmp_path_factory):
    shots = tmp_path_factory.mktemp("dashboard-screenshots")
    dash.problems.clear()
    for page in PAGES:
        dash.go(page)
        if page == "overview":
            assert dash.page.locator("[data-testid=chart] svg polyline").count() == 3
        dash.page.wait_for_load_state("networkidle")
        dash.page.wait_for_function("() => !document.querySelector('.htmx-request, .htmx-swapping, .htmx-settling')")
        dash.page.screenshot(path=str(shots / f"{page}.png"))
    print(f"\ndashboard screenshots: {shots}")
    assert not dash.problems, dash.problems
