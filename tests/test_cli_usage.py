"""`llmgw ctl usage`: the usage per key, model and hour (or day) as a table, JSON or CSV, through the REST API
(here the host's own, in process)."""

import csv
import io
import json
from datetime import UTC, datetime

import pytest
from django.core.management import CommandError, call_command

from gateway.models import ApiKey, Usage

pytestmark = pytest.mark.django_db(transaction=True)
DAY = datetime(2026, 3, 1, tzinfo=UTC)


def run(*args: str) -> str:
    out = io.StringIO()
    call_command("llmgw", *args, stdout=out)
    return out.getvalue()


@pytest.fixture
def used():
    agent = ApiKey.objects.create(name="agent", prefix="sk-llmgw-ag", key_hash="6" * 64)
    team = ApiKey.objects.create(name="team", prefix="sk-llmgw-te", key_hash="7" * 64)
    Usage.objects.bulk_create([
        Usage(key=agent, model="qwen", hour=DAY.replace(hour=9), requests=3, prompt_tokens=300, completion_tokens=30,
              resumed_prompt_tokens=25),
        Usage(key=agent, model="qwen", hour=DAY.replace(hour=17), requests=1, prompt_tokens=100, completion_tokens=10),
        Usage(key=team, model="smol", hour=DAY.replace(hour=12), requests=2, prompt_tokens=20, completion_tokens=2),
    ])


def test_csv_is_the_apis_header_row_first(used):
    printed = run("ctl", "usage", "--csv")
    rows = list(csv.reader(io.StringIO(printed)))
    assert rows[0] == ["key", "model", "hour", "requests", "prompt_tokens", "completion_tokens", "resumed_prompt_tokens"]
    assert rows[1:] == [["agent", "qwen", "2026-03-01T17:00:00Z", "1", "100", "10", "0"],
                        ["team", "smol", "2026-03-01T12:00:00Z", "2", "20", "2", "0"],
                        ["agent", "qwen", "2026-03-01T09:00:00Z", "3", "300", "30", "25"]]
    assert run("ctl", "usage", "--csv", "--by", "day", "--key", "agent").splitlines() == [
        "key,model,hour,requests,prompt_tokens,completion_tokens,resumed_prompt_tokens",
        "agent,qwen,2026-03-01T00:00:00Z,4,400,40,25"]


def test_by_day_as_a_table_and_as_json(used):
    table = run("ctl", "usage", "--by", "day")
    assert table.splitlines()[0].startswith("DAY") and "2026-03-01 " in table and "400" in table
    assert [r["requests"] for r in json.loads(run("ctl", "usage", "--by", "day", "--json"))] == [4, 2]
    assert [r["resumed_prompt_tokens"] for r in json.loads(run("ctl", "usage", "--by", "day", "--json"))] == [25, 0]
    assert "RESUMED (FLEET'S)" in table.splitlines()[0] and table.splitlines()[1].split()[-1] == "25"


@pytest.mark.parametrize("args, said", [
    (("ctl", "usage", "--csv", "--key", "nobody"), "no key named 'nobody'"),
    (("ctl", "usage", "--csv", "--json"), "not allowed with argument"),
    (("ctl", "usage", "--by", "week"), "invalid choice: 'week'"),
])
def test_what_it_cannot_do_is_said_in_one_line(used, args, said):
    with pytest.raises(CommandError) as refused:
        run(*args)
    assert said in str(refused.value) and "\n" not in str(refused.value)
