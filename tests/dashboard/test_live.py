"""The dashboard's websocket, `/ws/dashboard/`, through the project's ASGI application: a logged-in browser hears
which kinds of things changed, once per transaction; anyone else is turned away."""


import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator

from cluster import operations
from llmgw.asgi import application
from tests.factories import make_node, session_for
from tests.sockets import ends_by_itself

pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True)]

HOST = b"llmgw.test:8000"


@pytest.fixture
def cookie() -> str:
    """A logged-in viewer's session cookie."""
    return session_for("viewer").cookies["sessionid"].value


@pytest.fixture(autouse=True)
def llmgw_test_is_ours(settings):
    settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, "llmgw.test"]  # the name the pages here come from


def browser(cookie: str | None, origin: bytes = b"http://llmgw.test:8000", host: bytes = HOST, scheme: str = "ws",
            client: str = "10.0.0.7", **more: bytes) -> WebsocketCommunicator:
    headers = [(b"host", host), (b"origin", origin), *((k.replace("_", "-").encode(), v) for k, v in more.items())]
    if cookie:
        headers.append((b"cookie", f"sessionid={cookie}".encode()))
    page = WebsocketCommunicator(application, "/ws/dashboard/", headers=headers)
    page.scope.update(scheme=scheme, client=[client, 40000])
    return page


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
    assert await ends_by_itself(page)  # the server's disconnect that follows ends the consumer


async def test_a_page_from_another_site_may_not_listen(cookie):
    page = browser(cookie, origin=b"http://evil.example")
    connected, _ = await page.connect(timeout=3)
    assert not connected
    assert page.future.done()  # turned away without a consumer: nothing of it waits on the channel layer


@pytest.mark.parametrize(
    "origin, host, scheme, more, opens",
    [
        (b"https://llmgw.test:8000", HOST, "ws", {}, False),  # an https page does not open a plain socket
        (b"http://llmgw.test:8000", HOST, "wss", {}, False),  # nor an http page a TLS one
        (b"https://llmgw.test:8000", HOST, "wss", {}, True),
        (b"http://llmgw.test:8001", HOST, "ws", {}, False),  # another port is another origin
        (b"http://evil.example", b"evil.example", "ws", {}, False),  # a Host this server does not answer to
        (b"", HOST, "ws", {}, False),
    ],
)
async def test_the_origin_is_the_pages_scheme_host_and_port(cookie, origin, host, scheme, more, opens):
    page = browser(cookie, origin=origin, host=host, scheme=scheme, **more)
    connected, _ = await page.connect(timeout=3)
    assert connected == opens
    assert await ends_by_itself(page)


async def test_behind_a_trusted_proxy_that_ends_tls_the_page_is_https(cookie):
    """The proxy talks plain ws to us and says so in X-Forwarded-Proto; only a trusted one is believed."""
    proxied = {"x_forwarded_proto": b"https"}
    page = browser(cookie, origin=b"https://llmgw.test:8000", client="127.0.0.1", **proxied)
    assert (await page.connect(timeout=3))[0]
    await page.disconnect()
    stranger = browser(cookie, origin=b"https://llmgw.test:8000", client="10.0.0.7", **proxied)
    assert not (await stranger.connect(timeout=3))[0]
    assert await ends_by_itself(stranger)


async def test_a_closed_page_ends_even_if_the_channel_layer_swallows_its_cancel(cookie, a_swallowed_cancel):
    page = browser(cookie)
    connected, _ = await page.connect(timeout=3)
    assert connected
    assert await ends_by_itself(page)


async def test_with_the_channel_layer_away_the_page_is_told_to_try_again(cookie, channel_layer_at, caplog):
    # not a traceback in the log and an HTTP 500: the page's socket dials again, and the pages refresh on a timer
    channel_layer_at()  # nothing listens there
    page = browser(cookie)
    await page.send_input({"type": "websocket.connect"})
    answer = await page.receive_output(timeout=3)
    assert (answer["type"], answer["status"]) == ("websocket.http.response.start", 503)
    await page.wait(timeout=3)
    assert "Traceback" not in caplog.text and "the channel layer is away" in caplog.text
