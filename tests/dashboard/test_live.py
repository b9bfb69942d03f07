"""The dashboard's websocket, `/ws/dashboard/`, through the project's ASGI application: a logged-in browser hears
which kinds of things changed, once per transaction; anyone else is turned away."""

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator

from cluster import operations
from llmgw.asgi import application
from tests.factories import make_node, session_for

pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True)]

HOST = b"llmgw.test:8000"


@pytest.fixture
def cookie() -> str:
    """A logged-in viewer's session cookie."""
    return session_for("viewer").cookies["sessionid"].value


def browser(cookie: str | None, origin: bytes = b"http://llmgw.test:8000") -> WebsocketCommunicator:
    headers = [(b"host", HOST), (b"origin", origin)]
    if cookie:
        headers.append((b"cookie", f"sessionid={cookie}".encode()))
    return WebsocketCommunicator(application, "/ws/dashboard/", headers=headers)


async def test_a_viewer_hears_each_change_once_per_transaction(cookie):
    page = browser(cookie)
    connected, _ = await page.connect(timeout=3)
    assert connected
    await database_sync_to_async(make_node)("n1")
    await database_sync_to_async(operations.drain_node)("n1", "test")  # one transaction: drain + events
    said = await page.receive_json_from(timeout=3)
    assert said == {"changed": ["node"]}
    await database_sync_to_async(operations.stop_serving)("test")
    assert await page.receive_json_from(timeout=3) == {"changed": ["system"]}
    assert await page.receive_nothing(timeout=0.3)
    await page.disconnect()


async def test_without_a_session_the_socket_is_closed_for_the_login_page():
    page = browser(None)
    connected, code = await page.connect(timeout=3)
    assert not connected and code == 4401


async def test_a_page_from_another_site_may_not_listen(cookie):
    page = browser(cookie, origin=b"http://evil.example")
    connected, _ = await page.connect(timeout=3)
    assert not connected
