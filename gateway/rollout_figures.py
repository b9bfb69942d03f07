"""A rollout's two sides' figures, from the request records (gateway/records.py): what cluster/rollouts.py judges.

Each try of a request counts for the side of the replica it went to, and is an error when that replica
failed it: a 5xx answer, no connection, no answer in time, an answer that broke off (resumed elsewhere or not).
A request refused before any replica (a key's limit, a bad request) is neither side's. The latency figures are
the answered streams', by the side of the replica that began the answer: its time to first token, counted from
when that try began (not from the request's arrival: a wait in admission's queue, or a try on the other side that
failed first, is not the replica's, and a shadow's copy never waits in the queue), and the time per output token
after it (of a stream that was not resumed elsewhere). The newest ROWS records of the window are read, so a busy
model costs a bounded read.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import Any

from cluster.rollouts import Side
from gateway.models import RequestRecord
from gateway.records import RESUMED

ROWS = 20_000


def _failed(outcome: str) -> bool:
    if outcome.startswith("answered "):
        return outcome.endswith(RESUMED) or outcome[len("answered "):len("answered ") + 1] == "5"
    return not outcome.startswith("cancelled")


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values.sort()
    return round(values[min(len(values) - 1, int(q * len(values)))], 1)


class _Tally:
    def __init__(self) -> None:
        self.requests = self.errors = 0
        self.ttft: list[float] = []
        self.tpot: list[float] = []

    def side(self) -> Side:
        return Side(self.requests, self.errors, len(self.ttft), _percentile(self.ttft, 0.5),
                    _percentile(self.ttft, 0.99), _percentile(self.tpot, 0.5), _percentile(self.tpot, 0.99))


def sides(model: str, canary: frozenset[str], since: dt.datetime) -> tuple[Side, Side]:
    """The canary's and the current replicas' figures for `model` since `since`."""
    rows = (RequestRecord.objects.filter(model=model, at__gte=since).exclude(attempts=0)
            .order_by("-at").values_list("replica", "status", "streamed", "ttft_ms", "total_ms", "completion_tokens",
                                         "tries")[:ROWS])
    return tally(rows, canary)


def tally(rows: Iterable[tuple[Any, ...]], canary: frozenset[str]) -> tuple[Side, Side]:
    on = {True: _Tally(), False: _Tally()}
    for replica, status, streamed, ttft, total, tokens, tries in rows:
        for i, (name, _started, _ended, outcome) in enumerate(tries or ()):
            t = on[name in canary]
            t.requests += 1
            last = i == len(tries) - 1
            if _failed(outcome) or (last and status >= 500 and outcome.startswith("answered 2")):
                t.errors += 1
        began = next((try_ for try_ in tries or () if try_[3].startswith("answered 2")), None)
        if status == 200 and streamed and ttft is not None and began is not None:
            name, started, _, outcome = began
            t = on[name in canary]
            t.ttft.append(max(0.0, ttft - started))
            if name == replica and not outcome.endswith(RESUMED) and tokens and tokens > 1 and total > ttft:
                t.tpot.append((total - ttft) / (tokens - 1))
    return on[True].side(), on[False].side()
