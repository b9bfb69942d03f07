"""The overview's server-drawn charts: scale, points and the three series from the traffic counters."""

from dashboard.charts import HEIGHT, WIDTH, Chart, traffic_charts


def test_the_axis_top_is_the_peak_rounded_up_to_1_2_5():
    assert Chart("t", "u", [0, 0], "#000").top == 1
    assert Chart("t", "u", [0.3], "#000").top == 1
    assert Chart("t", "u", [1.5], "#000").top == 2
    assert Chart("t", "u", [3], "#000").top == 5
    assert Chart("t", "u", [7.5], "#000").top == 10
    assert Chart("t", "u", [120], "#000").top == 200


def test_points_span_the_width_and_the_height():
    chart = Chart("t", "u", [0, 5, 10], "#000")
    assert chart.line == f"0.0,{HEIGHT}.0 {WIDTH / 2},{HEIGHT / 2} {WIDTH}.0,0.0"
    assert chart.area.startswith(f"M0,{HEIGHT} L0.0,{HEIGHT}.0") and chart.area.endswith(f"L{WIDTH},{HEIGHT} Z")
    assert (chart.now, chart.peak, chart.top_label) == ("10.0", "10.0", "10.0")


def test_the_three_series():
    rows = [{"minute": 1, "requests": 0, "errors": 0, "tokens": 0}, {"minute": 2, "requests": 120, "errors": 6, "tokens": 600}]
    rps, tps, errors = traffic_charts(rows)
    assert rps.values == [0, 2] and tps.values == [0, 10] and errors.values == [0, 5]
    assert errors.now == "5"


def test_the_overview_shows_time_to_first_token_from_the_traffic_counters(db):
    """p50 and p95 over the last hour, from what every web process counted into Redis (gateway.accounting)."""
    import asyncio
    import time

    import redis.asyncio as aioredis
    from django.conf import settings

    from gateway.accounting import Ledger
    from tests.factories import session_for

    ledger = Ledger()
    now = time.time() - 120  # a whole minute that is over
    for _ in range(19):
        ledger.count(200, 5, now=now, first_chunk=0.08)
    ledger.count(200, 5, now=now, first_chunk=4.0)

    async def flush():
        client = aioredis.Redis.from_url(settings.REDIS_URL)
        await ledger.flush_traffic(client)
        await client.aclose()

    asyncio.run(flush())
    page = session_for("viewer").get("/").content.decode()
    assert 'data-testid="ttft"' in page and "Time to first token, last hour" in page
    assert "streamed requests, every web process" in page
    assert "<small>p50</small> " in page and " ms</span>" in page
