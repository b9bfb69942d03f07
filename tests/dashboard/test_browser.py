"""The dashboard's pages in headless Chromium (Debian's, driven by Playwright) against Django's live test server:
what only a browser decides — whether a form's `pattern` compiles (browsers compile it with the `v` flag and
silently drop one that does not), and whether a page fits a phone's width. No agent, worker or engine: the
clicking against the whole system is tests/integration/test_dashboard.py."""

from __future__ import annotations

import pytest

from dashboard.views import PAGES
from tests.factories import make_file, make_model, make_node, make_replica, make_user
from tests.integration.test_dashboard import ARGS, CHROMIUM

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

PHONE = {"width": 390, "height": 844}


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    # Playwright's sync API keeps an event loop on this thread, which Django takes for an async context: the test's
    # own database calls are synchronous all the same
    with pytest.MonkeyPatch.context() as patch, sync_playwright() as p:
        patch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        chromium = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        yield chromium
        chromium.close()


def signed_in(browser, live_server, role: str, viewport: dict):
    """A browser page logged in (by session cookie) as a new user of `role`."""
    from django.test import Client

    user, _ = make_user(role)
    client = Client()
    client.force_login(user)
    context = browser.new_context(viewport=viewport, base_url=live_server.url)
    context.set_default_timeout(15_000)
    host = live_server.url.split("//", 1)[1].split(":")[0]
    context.add_cookies([{"name": "sessionid", "value": client.cookies["sessionid"].value, "domain": host, "path": "/"}])
    return context, context.new_page()


def url(page: str) -> str:
    return "/" if page == "overview" else f"/{page}/"


def a_fleet() -> None:
    """Enough on every page that its tables have rows (a long name, a long command) to overflow a phone."""
    from cluster.models import EngineVersion, Profile

    # what the migrations made (a transactional test's database is emptied after it)
    EngineVersion.objects.get_or_create(name="llama.cpp", defaults={"kind": "llama.cpp"})
    Profile.objects.get_or_create(name="default")
    node = make_node("gpu-node-with-a-rather-long-name-1", facts={
        "memory_total_bytes": 32 * 1024**3, "gpus": [{"index": 0, "name": "NVIDIA L4", "memory_bytes": 24 * 1024**3}]})
    model = make_model(name="qwen2.5-coder-32b-instruct-q4-k-m", file=make_file(name="a-very-long-model-file-name.gguf"))
    make_replica(model, node, gpu_index=0, memory_bytes=2 * 1024**3)


def test_every_name_pattern_compiles_as_browsers_compile_it_and_refuses_a_bad_name(browser, live_server):
    context, tab = signed_in(browser, live_server, "admin", {"width": 1280, "height": 800})
    try:
        checked = []
        for page in PAGES:
            tab.goto(url(page))
            for field in tab.locator("input[pattern]").all():
                pattern = field.get_attribute("pattern")
                problem = tab.evaluate("p => { try { new RegExp(p, 'v'); return '' } catch (e) { return String(e) } }",
                                       pattern)
                assert not problem, (page, pattern, problem)
                checked.append((page, field.get_attribute("name")))
        tab.goto("/nodes/")
        name = tab.locator("form[hx-post$='/nodes/add/'] input[name=name]")
        for bad in ("GPU 1", "-gpu", "gpu_1!", "x" * 64):
            name.fill(bad)
            assert not name.evaluate("e => e.checkValidity()"), bad
        for good in ("gpu-1", "gpu.1", "gpu_1", "x" * 63):
            name.fill(good)
            assert name.evaluate("e => e.checkValidity()"), good
        assert "lower-case letters" in name.get_attribute("title")
        assert ("nodes", "name") in checked
    finally:
        context.close()


def test_every_page_fits_a_phone_and_its_nav_reaches_every_page(browser, live_server):
    """At a phone's width (390 px) no page scrolls sideways as a whole: the nav wraps, a wide table scrolls inside
    its card, forms stack. Every page is reached from the nav by a tap."""
    from gateway import operations as gateway_operations

    a_fleet()
    gateway_operations.create_key("a-key-with-a-long-name-for-a-team", "test", models=[])
    context, tab = signed_in(browser, live_server, "admin", PHONE)
    try:
        tab.goto("/")
        for page in PAGES:
            link = tab.locator(f"nav a[data-page={page}]")
            link.click()  # Playwright scrolls it into view and clicks only what is visible and takes the tap
            tab.wait_for_url(live_server.url + url(page))
            tab.wait_for_load_state("networkidle")
            wide = tab.evaluate("""() => ({scroll: document.documentElement.scrollWidth, view: window.innerWidth,
                culprits: [...document.querySelectorAll('body *')].filter(e => e.getBoundingClientRect().right
                  > window.innerWidth + 1 && !e.closest('.scroll, .card, pre')).slice(0, 5)
                  .map(e => e.outerHTML.slice(0, 80))})""")
            assert wide["scroll"] <= wide["view"], (page, wide)
            for field in tab.locator("main form input:visible, main form select:visible").all():
                box = field.bounding_box()
                assert box["x"] >= 0 and box["x"] + box["width"] <= PHONE["width"], (page, field.get_attribute("name"))
    finally:
        context.close()


def test_the_usage_plots_fit_a_phone_in_one_column_and_the_day_switch_redraws_them(browser, live_server):
    """At 390 px the plots stack in one column, each as wide as its card and no wider than the screen, and the
    page does not scroll sideways; By day redraws them (htmx) with a day's bars in place of an hour's."""
    from datetime import timedelta

    from django.utils import timezone

    from gateway.models import ApiKey, Usage

    hour = timezone.now().replace(minute=0, second=0, microsecond=0)
    key = ApiKey.objects.create(name="a-key-with-a-long-name-for-a-team", prefix="sk-llmgw-lo", key_hash="a" * 64,
                                budget_tokens=10_000, budget_period="day")
    Usage.objects.bulk_create([Usage(key=key, model="qwen2.5-coder-32b-instruct-q4-k-m", hour=hour - timedelta(hours=h),
                                     requests=1 + h, prompt_tokens=100 * h, completion_tokens=10) for h in range(0, 40, 3)])
    context, tab = signed_in(browser, live_server, "viewer", PHONE)
    try:
        tab.goto("/usage/")
        cards = tab.locator("[data-testid=usage-plot]")
        assert cards.count() == 4
        boxes = [cards.nth(i).bounding_box() for i in range(4)]
        assert len({round(b["x"]) for b in boxes}) == 1 and all(b["x"] + b["width"] <= PHONE["width"] for b in boxes)
        assert boxes == sorted(boxes, key=lambda b: b["y"])  # one under the other
        for svg in tab.locator("[data-testid=usage-plot] svg").all():
            box = svg.bounding_box()
            assert 250 < box["width"] <= PHONE["width"] and box["height"] > 0
        width = tab.evaluate("() => [document.documentElement.scrollWidth, window.innerWidth]")
        assert width[0] <= width[1], width
        hourly = tab.locator("[data-plot=tokens-by-key] rect").count()
        tab.locator("fieldset.switch label", has_text="By day").click()
        tab.wait_for_selector("#live[data-by=day]")
        assert "by=day" in tab.url
        daily = tab.locator("[data-plot=tokens-by-key] rect").count()
        assert hourly == 14 and daily in (2, 3), (hourly, daily)  # 40 hours fall on two or three days
        assert tab.evaluate("() => document.documentElement.scrollWidth <= window.innerWidth")
        assert "by=day" in tab.locator("a.download").get_attribute("href")
    finally:
        context.close()


def test_a_rollout_shows_both_sides_and_is_promoted_by_a_click(browser, live_server):
    """A rollout watching (its canary placed by the reconciler and ready by its agent's report), on its page: the
    canary and the current replicas side by side, each with its figures; Promote, confirmed, and the page says
    promoting. At a phone's width the page does not scroll sideways."""
    from cluster import operations, reconciler
    from cluster.models import Model, Replica
    from cluster.operations.rollouts import carry_on
    from gateway import rollout_figures
    from tests.cluster.test_reconciler import report
    from tests.factories import make_agent_node, make_profile, seed_defaults

    seed_defaults()
    make_agent_node("n1", memory_bytes=8 * 1024**3, port_range=(21000, 21019))
    model = make_model(name="m1", replicas=2, memory_bytes=1024**3)
    make_profile("fast", context_size=8192, threads=2)
    reconciler.reconcile_once()
    report(Replica.objects.filter(model=model), "ready")
    rollout = operations.start_rollout("m1", "user:alice", profile="fast")
    reconciler.reconcile_once()
    report(Replica.objects.filter(rollout=rollout), "ready")
    carry_on(rollout_figures.sides)  # the window begins
    carry_on(rollout_figures.sides)  # judged: both sides' figures
    context, tab = signed_in(browser, live_server, "operator", {"width": 1280, "height": 800})
    try:
        tab.on("dialog", lambda d: d.accept())  # the confirmation: yes
        tab.goto("/models/")
        tab.locator("#model-m1 a[data-testid=rollout]", has_text="rollout watching").click()
        tab.wait_for_url(live_server.url + "/models/m1/rollout/")
        assert tab.locator("[data-testid=rollout-state]").inner_text() == "watching"
        canary, current = tab.locator("[data-side=canary]"), tab.locator("[data-side=current]")
        assert canary.locator("tr[data-replica]").count() == 1 and current.locator("tr[data-replica]").count() == 2
        assert canary.locator("[data-figure=requests]").inner_text() == "0"
        left, right = canary.bounding_box(), current.bounding_box()
        assert left["x"] + left["width"] <= right["x"] and abs(left["y"] - right["y"]) < 1  # side by side
        tab.set_viewport_size(PHONE)
        assert tab.evaluate("() => document.documentElement.scrollWidth <= window.innerWidth")
        tab.locator("button", has_text="Promote").click()
        tab.wait_for_selector("#live[data-state=promoting]")
        assert "rollout of model m1 promoting" in tab.locator("#messages").inner_text()
        assert tab.locator("button", has_text="Promote").count() == 0
        assert Model.objects.get(name="m1").profile.name == "fast"
        # while it promotes, Abort sends the model back to its settings before
        tab.locator("button", has_text="Abort").click()
        tab.wait_for_selector("#live[data-state=rolling_back]")
        assert "rollout of model m1 rolling back" in tab.locator("#messages").inner_text()
        assert Model.objects.get(name="m1").profile.name == "default"
    finally:
        context.close()
