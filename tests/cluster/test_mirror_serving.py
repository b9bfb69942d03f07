"""cluster/mirror/serving.py: the Range rule, and a file this control plane does not hold yet relayed from another
through `/mirror/<sha256>`."""

import hashlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from asgiref.sync import sync_to_async
from django.db import connections
from django.test import AsyncClient

from cluster.mirror import serving
from cluster.models import Node
from tests.factories import make_control_plane, make_file, make_node

NODE_TOKEN = "lnt_serving-test-token"


@pytest.mark.parametrize("header, span", [
    ("", (0, 99, False)),
    ("bytes=0-", (0, 99, True)),
    ("bytes=10-20", (10, 20, True)),
    ("  bytes=10-20 ", (10, 20, True)),  # as the view read it: stripped
    ("bytes=99-", (99, 99, True)),
    ("bytes=90-1000", (90, 99, True)),  # cut at the end
    ("bytes=5-5", (5, 5, True)),
])
def test_a_range_gives_those_bytes(header, span):
    got = serving.byte_range(header, 100)
    assert got is not None and (got.start, got.end, got.partial) == span
    assert got.length == span[1] - span[0] + 1 and got.content_range == f"bytes {span[0]}-{span[1]}/100"


@pytest.mark.parametrize("header", ["bytes=100-", "bytes=20-10", "bytes=abc", "lines=1-2", "bytes=-5", "bytes=1-2,4-5",
                                    " ", "bytes=" + "9" * 20 + "-"])
def test_a_range_with_no_bytes_to_give_is_none(header):
    assert serving.byte_range(header, 100) is None


def test_an_empty_file_is_given_whole_and_no_range_of_it():
    whole = serving.byte_range("", 0)
    assert whole is not None and (whole.length, whole.partial) == (0, False)
    assert serving.byte_range("bytes=0-", 0) is None


BODY = b"weights from another control plane " * 1000
SHA = hashlib.sha256(BODY).hexdigest()


@pytest.fixture
def peer() -> Iterator[tuple[str, list[tuple[str, str | None, str | None]]]]:
    """Another control plane's /mirror over http, holding BODY (Range `bytes=N-` only): its URL, and the requests
    it was sent (path, Range, Authorization)."""
    asked: list[tuple[str, str | None, str | None]] = []

    class Mirror(BaseHTTPRequestHandler):
        def do_GET(self):
            asked.append((self.path, self.headers.get("Range"), self.headers.get("Authorization")))
            start = int(self.headers["Range"][6:-1]) if self.headers.get("Range") else 0
            if self.path != f"/mirror/{SHA}" or start >= len(BODY):
                self.send_response(416 if self.path == f"/mirror/{SHA}" else 404)
                self.send_header("Content-Range", f"bytes */{len(BODY)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(206 if start else 200)
            self.send_header("Content-Length", str(len(BODY) - start))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("X-Sha256", SHA)
            self.send_header("X-Not-Passed-On", "1")
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(BODY) - 1}/{len(BODY)}")
            self.end_headers()
            self.wfile.write(BODY[start:])

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Mirror)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", asked
    server.shutdown()
    server.server_close()


@pytest.fixture
def not_here(transactional_db, this_control_plane, peer):
    """BODY's row, held by cp-2 (the peer) and not by this control plane."""
    make_node("gpu-1", token_hash=Node.hash_token(NODE_TOKEN))
    make_control_plane("cp-2", url=peer[0], holds=(make_file("w.bin", size=len(BODY), gguf=False, sha256=SHA),))
    yield peer[1]
    connections.close_all()


async def fetch(token: str = NODE_TOKEN, **headers):
    return await AsyncClient().get(f"/mirror/{SHA}", headers={"Authorization": f"Bearer {token}", **headers})


async def body(response) -> bytes:
    return b"".join([chunk async for chunk in response.streaming_content])


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_a_file_not_here_is_relayed_from_a_control_plane_that_holds_it(not_here, this_control_plane):
    response = await fetch(Range="bytes=7-")
    assert (response.status_code, response["X-Llmgw-Mirror"], response["X-Sha256"]) == (206, "cp-2", SHA)
    assert response["Content-Range"] == f"bytes 7-{len(BODY) - 1}/{len(BODY)}"
    assert not response.has_header("X-Not-Passed-On")
    assert await body(response) == BODY[7:]
    path, asked_range, auth = not_here[0]
    assert (path, asked_range) == (f"/mirror/{SHA}", "bytes=7-") and auth.startswith("Bearer lcp_cp-1-")
    response = await fetch(Range=f"bytes={len(BODY)}-")
    assert (response.status_code, response["Content-Range"]) == (416, f"bytes */{len(BODY)}")
    await sync_to_async(connections.close_all)()


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_a_peer_s_own_request_is_not_passed_on(not_here):
    response = await fetch(token="lcp_cp-2")
    assert response.status_code == 404
    assert response.json() == {"detail": f"file {SHA} is on no control plane that answers"}
    assert not_here == []
    await sync_to_async(connections.close_all)()
