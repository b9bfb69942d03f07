"""The dashboard's Usage page: the plots of the usage by hour or day, filtered by key and model, each key's budget,
and the same rows as a CSV download."""

import csv
import io
import re
from datetime import timedelta

import pytest
from django.utils import timezone

from gateway.models import ApiKey, RequestRecord, Usage
from tests.factories import session_for

HTMX = {"HTTP_HX_REQUEST": "true"}


@pytest.fixture
def used(db):
    hour = timezone.now().replace(minute=0, second=0, microsecond=0)
    agent = ApiKey.objects.create(name="agent", prefix="sk-llmgw-ag", key_hash="8" * 64, budget_tokens=1000,
                                  budget_period="month")
    team = ApiKey.objects.create(name="team", prefix="sk-llmgw-te", key_hash="9" * 64)
    Usage.objects.bulk_create([
        Usage(key=agent, model="qwen", hour=hour, requests=4, prompt_tokens=200, completion_tokens=50),
        Usage(key=agent, model="smol", hour=hour - timedelta(hours=1), requests=1, prompt_tokens=30, completion_tokens=20),
        Usage(key=team, model="qwen", hour=hour - timedelta(days=3), requests=2, prompt_tokens=700, completion_tokens=0),
    ])
    RequestRecord.objects.create(request_id="e", at=timezone.now(), key=agent, model="qwen", surface="messages",
                                 status=503, total_ms=1.0)
    return session_for("viewer")


def plots(body: str) -> list[str]:
    return re.findall(r'data-plot="([^"]+)"', body)


def values(body: str, plot: str) -> list[str]:
    """The values drawn as bars in one plot, left to right and bottom up."""
    card = body.split(f'data-plot="{plot}"', 1)[1].split('data-testid="usage-plot"', 1)[0]
    return re.findall(r'data-value="([^"]+)"', card)


def test_a_viewer_sees_the_plots_by_hour_and_by_day(used):
    body = used.get("/usage/").content.decode()
    assert plots(body) == ["tokens-by-key", "tokens-by-model", "requests", "budgets"]
    assert body.count("<svg viewBox=") == 4 and 'data-page="usage"' in body  # in the nav
    assert values(body, "tokens-by-key") == ["50", "250"]  # the team's tokens of 3 days ago are not in 48 hours
    assert values(body, "requests") == ["1", "4", "1"]  # requests, then the error in front
    assert "agent: 300 of 1K this month (30%)" in body
    daily = used.get("/usage/?by=day", **HTMX).content.decode()
    assert 'data-by="day"' in daily and "<nav" not in daily
    assert values(daily, "tokens-by-key")[-1] in ("300", "250")  # today's (the hour before may be yesterday)
    assert "700" in values(daily, "tokens-by-key")


def test_the_filters_narrow_the_plots_and_a_wrong_one_is_said(used):
    body = used.get("/usage/?key=agent&model=qwen", **HTMX).content.decode()
    assert values(body, "tokens-by-model") == ["250"] and "key agent, model qwen" in body
    assert "by=hour&amp;key=agent&amp;model=qwen" in body  # the download asks for what is shown
    assert "no key named &#x27;nobody&#x27;" in used.get("/usage/?key=nobody", **HTMX).content.decode()
    assert "Select a valid choice" in used.get("/usage/?by=week", **HTMX).content.decode()


def test_the_csv_download_is_the_apis_rows_for_what_is_shown(used):
    response = used.get("/usage/csv/?by=day&key=team")
    assert response["Content-Type"] == "text/csv; charset=utf-8" and "attachment" in response["Content-Disposition"]
    rows = list(csv.reader(io.StringIO(response.content.decode())))
    assert rows[0] == ["key", "model", "hour", "requests", "prompt_tokens", "completion_tokens", "resumed_prompt_tokens"]
    assert [r[:2] + r[3:] for r in rows[1:]] == [["team", "qwen", "2", "700", "0", "0"]] and rows[1][2].endswith("T00:00:00Z")
    assert len(used.get("/usage/csv/").content.decode().splitlines()) == 3  # by hour: the last 48 hours'
    assert used.get("/usage/csv/?key=nobody").status_code == 404
    assert used.get("/usage/csv/?by=week").status_code == 400


def test_resumes_prompt_tokens_are_plotted_as_the_fleets_apart_from_the_keys_tokens(used):
    Usage.objects.filter(model="qwen", key__name="agent").update(resumed_prompt_tokens=600)
    body = used.get("/usage/").content.decode()
    assert plots(body) == ["tokens-by-key", "tokens-by-model", "requests", "resumed-by-model", "budgets"]
    assert values(body, "resumed-by-model") == ["600"] and values(body, "tokens-by-key") == ["50", "250"]
    assert "the fleet&#x27;s cost, not the keys&#x27;" in body
