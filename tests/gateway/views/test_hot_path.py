"""A routed request makes no database query once the routing table is warm."""

import threading
from collections.abc import Iterator
from contextlib import asynccontextmanager, contextmanager

import pytest
from asgiref.sync import sync_to_async
from django.db import connections
from django.db.backends.utils import CursorWrapper
from django.test.utils import CaptureQueriesContext

from tests.gateway.views.harness import (
    chat,
    post,
    read,
)

# every test here routes to tests/engine.py running as a process
pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True), pytest.mark.integration]


# No database query on the hot path


@contextmanager
def every_query() -> Iterator[list[tuple[str, str]]]:
    """Every SQL statement Django runs, on any connection in any thread. CaptureQueriesContext sees one
    connection only, and the gateway loads its table on another: sync_to_async(thread_sensitive=True) runs in
    asgiref's single worker thread, not the test's (there is no outer async_to_sync to hand it back to)."""
    seen: list[tuple[str, str]] = []
    real = CursorWrapper._execute_with_wrappers  # type: ignore[attr-defined]  # Django's, private: not in its stubs

    def counting(cursor, sql, params, many, executor):
        seen.append((threading.current_thread().name, sql))
        return real(cursor, sql, params, many, executor)

    CursorWrapper._execute_with_wrappers = counting  # type: ignore[attr-defined]  # as above
    try:
        yield seen
    finally:
        CursorWrapper._execute_with_wrappers = real  # type: ignore[attr-defined]  # as above


@asynccontextmanager
async def queries_where_the_table_loads():
    """CaptureQueriesContext on the connection of the thread the gateway's table loads on."""
    conn = await sync_to_async(lambda: connections["default"], thread_sensitive=True)()
    captured = CaptureQueriesContext(conn)
    await sync_to_async(captured.__enter__, thread_sensitive=True)()
    try:
        yield captured
    finally:
        await sync_to_async(captured.__exit__, thread_sensitive=True)(None, None, None)


async def routed_requests(client, n: int) -> None:
    for i in range(n):
        kind = i % 5
        if kind == 0:
            response = await chat(client)
        elif kind == 1:
            response = await chat(client, stream=True)
        elif kind == 2:
            response = await post(client, "completions", {"model": "qwen", "prompt": "hi"})
        elif kind == 3:
            response = await post(client, "embeddings", {"model": "qwen", "input": "hi"})
        else:
            response = await client.get("/v1/models")
        assert response.status_code == 200, response.content
        await read(response)


async def test_routed_requests_make_no_database_query_once_warm(client, settings):
    settings.LLMGW_GATEWAY_REFRESH = 300  # no timed reload inside the window: what is left is per request

    async with queries_where_the_table_loads() as loading_thread:
        with every_query() as warm_up:
            await routed_requests(client, 1)
    # the measurement is real: it sees the first request load the table, in the thread where that happens
    assert len(warm_up) >= 4, warm_up
    assert {thread for thread, _ in warm_up} != {threading.current_thread().name}
    assert len(loading_thread.captured_queries) == len(warm_up)

    async with queries_where_the_table_loads() as loading_thread:
        with every_query() as warm:
            await routed_requests(client, 50)
    assert warm == []
    assert loading_thread.captured_queries == []
