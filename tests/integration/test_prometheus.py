"""The Grafana dashboard in docs/grafana/llmgw.json queries what llmgw exports: Debian's Prometheus scrapes a
running llmgw's /metrics (with an API token, as docs/gateway.md says to), and every query of every panel, and the
model variable's, runs through its HTTP API, valid, naming only metrics Prometheus has, and with a series to show.
A panel that asks for a metric llmgw does not export, or a label value it never has, fails here."""

import json
import re
import shutil
import signal
from pathlib import Path

import httpx
import openai
import pytest

from ground.ports import free_port
from tests.integration.harness import add_test_engine, wait_for

pytestmark = pytest.mark.integration

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "llmgw.json"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"  # Debian's (bin/setup-debian)
# what Grafana puts in place of its own variables when it sends a query; the dashboard's variables become `.*`
GRAFANA = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}
# PromQL's words that are not metric names
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
            "offset", "inf", "nan"}


def queries(dashboard: dict) -> dict[str, str]:
    """Every panel's every query, by where it is, with Grafana's variables and the dashboard's put in."""
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    found = {}
    for panel in [*dashboard["panels"], *(p for row in dashboard["panels"] for p in row.get("panels", []))]:
        assert panel["type"] == "row" or panel.get("targets"), f"{panel['title']}: a panel with no query"
        for target in panel.get("targets", []):
            # the data source the importer picks, never one of the machine it was exported from
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}", (panel["title"], target["datasource"])
            expr = target["expr"]
            for name, value in GRAFANA.items():
                expr = expr.replace(name, value)
            for name in variables:
                expr = re.sub(rf"\$(?:{name}\b|\{{{name}\}})", ".*", expr)
            assert "$" not in expr, f"{panel['title']}: a variable the dashboard does not define: {target['expr']}"
            found[f"{panel['title']} / {target['refId']}"] = expr
    return found


def metric_names(expr: str) -> set[str]:
    """The metrics a PromQL expression reads: its words left once strings, label matchers, ranges, label lists
    and functions are taken out."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    return {w for w in re.findall(r"\b[A-Za-z_:][A-Za-z0-9_:]*\b(?!\s*\()", text) if w.lower() not in KEYWORDS}


def test_metric_names_are_what_a_query_reads():
    expr = 'histogram_quantile(0.95, sum by (model, le) (rate(a_bucket{model=~".*", le="1.0"}[1m]))) - max(b) or c'
    assert metric_names(expr) == {"a_bucket", "b", "c"}


@pytest.fixture(scope="module")
def prometheus(system, tmp_path_factory):
    """Debian's Prometheus on loopback scraping the system's web process every second; stopped at the end."""
    if not Path(PROMETHEUS).exists():
        pytest.fail("Debian's prometheus is not installed: bin/setup-debian installs it")
    home = tmp_path_factory.mktemp("prometheus")
    (home / "token").write_text(system.admin_token)
    (home / "prometheus.yml").write_text(json.dumps({  # JSON is YAML
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{
            "job_name": "llmgw", "metrics_path": "/metrics",
            "authorization": {"type": "Bearer", "credentials_file": str(home / "token")},
            "static_configs": [{"targets": [system.url.removeprefix("http://")]}],
        }],
    }))
    url = f"http://127.0.0.1:{free_port()}"
    proc = system.spawn("prometheus", [
        PROMETHEUS, f"--config.file={home / 'prometheus.yml'}", f"--storage.tsdb.path={home / 'data'}",
        f"--web.listen-address={url.removeprefix('http://')}", "--log.level=warn",
    ])
    try:
        wait_for(lambda: _ready(url), 30, interval=0.2, what="prometheus ready")
        yield url
    finally:
        system.procs.pop("prometheus", None)
        proc.stop(signal.SIGKILL)  # its data is thrown away: no need of the seconds its clean shutdown takes


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/-/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def query(prometheus: str, expr: str) -> dict:
    answered = httpx.get(prometheus + "/api/v1/query", params={"query": expr}, timeout=10).json()
    assert answered["status"] == "success", (expr, answered)
    return answered["data"]


def test_every_query_of_the_dashboard_reads_what_llmgw_exports(system, prometheus):
    add_test_engine(system, name="prom-echo", args="--parallel {parallel}")  # slots: admission counts
    system.cli("ctl", "model", "add", "prom-chat", "--file", system.sha, "--engine", "prom-echo",
               "--replicas", "1", "--memory", "100MiB")
    key = system.cli("ctl", "keys", "create", "prom-key").stdout.split()[-1]
    broke = system.cli("ctl", "keys", "create", "prom-broke", "--budget", "1/day").stdout.split()[-1]
    try:
        system.wait_ready("prom-chat", 1)
        client = openai.OpenAI(base_url=system.url + "/v1", api_key=key, max_retries=0, timeout=30)
        hello = [{"role": "user", "content": "Say hello"}]
        client.chat.completions.create(model="prom-chat", messages=hello)
        assert "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="prom-chat", messages=hello, stream=True) if c.choices)  # a first token, timed
        with pytest.raises(openai.RateLimitError) as refused:  # a refusal, by its reason
            openai.OpenAI(base_url=system.url + "/v1", api_key=broke, max_retries=0, timeout=30).chat.completions.create(
                model="prom-chat", messages=hello)
        assert refused.value.code == "budget_exceeded"

        # two scrapes since the refusal, the last request: every rate has two samples to go on (Prometheus hands
        # its targets to the scrapers 5 s after it starts, the most of this test's time)
        scraped = 'sum(count_over_time(llmgw_rejected_requests_total{model="prom-chat"}[1m])) >= 2'
        wait_for(lambda: query(prometheus, scraped)["result"], 30, what="two scrapes of the refusal")

        dashboard = json.loads(DASHBOARD.read_text())
        exported = set(httpx.get(prometheus + "/api/v1/label/__name__/values", timeout=10).json()["data"])
        found = queries(dashboard)
        assert len(found) >= 12, found
        variable = next(v for v in dashboard["templating"]["list"] if v["name"] == "model")
        (read,) = re.fullmatch(r"label_values\((\w+), model\)", variable["query"]).groups()
        assert read in exported and "prom-chat" in httpx.get(
            prometheus + "/api/v1/label/model/values", params={"match[]": read}, timeout=10).json()["data"]
        empty, shown = {}, {}
        for where, expr in found.items():
            names = metric_names(expr)
            assert names and names <= exported, (where, expr, names - exported)
            try:  # a scrape that timed out on a loaded machine leaves the series stale until the next one
                shown[where] = wait_for(lambda e=expr: query(prometheus, e)["result"], 10, what=where)
            except AssertionError:
                empty[where] = expr
        assert not empty, f"queries with nothing to show: {empty}"
        assert "budget_exceeded" in {s["metric"].get("reason") for s in shown["Refused by reason / A"]}
        ready = {s["metric"]["state"]: float(s["value"][1]) for s in shown["Replicas by state / A"]}
        assert set(ready) == {"pending", "downloading", "starting", "ready", "draining", "stopping", "stopped",
                              "failed"} and ready["ready"] >= 1, ready
    finally:
        system.cli("ctl", "keys", "revoke", "prom-key", check=False)
        system.cli("ctl", "keys", "revoke", "prom-broke", check=False)
        system.cli("ctl", "model", "remove", "prom-chat", check=False)
        wait_for(lambda: "prom-chat" not in {m["name"] for m in system.cli_json("ctl", "models")}, 60,
                 what="prom-chat removed")  # the next module's tests find the fleet as they left it
