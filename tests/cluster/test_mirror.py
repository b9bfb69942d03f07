"""`/mirror/<sha256>` through Django's async test client: who may fetch, whole files and ranges."""

import hashlib
import os

import pytest
import pytest_asyncio
from asgiref.sync import sync_to_async
from django.db import connections
from django.test import AsyncClient

from cluster import operations, peers
from cluster.mirror import store
from cluster.models import Node
from tests.factories import make_control_plane, make_file, make_node, make_user

pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True)]

DATA = os.urandom(3 * 1024 * 1024 + 123)  # more than one of the view's 1 MiB chunks
NODE_TOKEN = "lnt_mirror-test-token"


@pytest_asyncio.fixture(autouse=True)
async def _close_the_views_connection():
    """The test client keeps Django from closing the view's database connection (in asgiref's one sync thread)
    when a request ends; close it, or PostgreSQL cannot drop the test database at the end."""
    yield
    await sync_to_async(connections.close_all)()


@pytest.fixture
def stored(tmp_path):
    """DATA in the mirror as a ModelFile row, and its sha256."""
    source = tmp_path / "model.bin"
    source.write_bytes(DATA)
    sha, size, path = store.store(source)
    assert path.read_bytes() == DATA and sha == hashlib.sha256(DATA).hexdigest()
    make_file("model.bin", size=size, gguf=False, sha256=sha)
    yield sha
    store.remove(sha)


@pytest.fixture
def node(transactional_db):
    return make_node("gpu-1", token_hash=Node.hash_token(NODE_TOKEN))


async def fetch(sha: str, client: AsyncClient | None = None, token: str | None = NODE_TOKEN, **headers):
    """GET the file, with the node token unless `token` is None. (Headers go per request: this Django's AsyncClient
    mangles the ones given to its constructor into `http-authorization`.)"""
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return await (client or AsyncClient()).get(f"/mirror/{sha}", headers=headers)


async def as_user(role: str) -> AsyncClient:
    user, _ = await sync_to_async(make_user)(role)
    client = AsyncClient()
    await client.aforce_login(user)
    return client


async def body(response) -> bytes:
    return b"".join([chunk async for chunk in response.streaming_content])


async def test_an_agent_downloads_the_whole_file(stored, node):
    response = await fetch(stored)
    assert response.status_code == 200
    assert response["Content-Length"] == str(len(DATA))
    assert response["Content-Type"] == "application/octet-stream"
    assert response["Accept-Ranges"] == "bytes"
    assert response["X-Sha256"] == stored
    assert not response.has_header("Content-Range")
    assert await body(response) == DATA


@pytest.mark.parametrize("start", [0, 1, 1024 * 1024, len(DATA) - 1])
async def test_an_open_range_resumes_from_there(stored, node, start):
    response = await fetch(stored, Range=f"bytes={start}-")
    assert response.status_code == 206
    assert response["Content-Range"] == f"bytes {start}-{len(DATA) - 1}/{len(DATA)}"
    assert response["Content-Length"] == str(len(DATA) - start)
    assert await body(response) == DATA[start:]


@pytest.mark.parametrize("first, last", [(0, 0), (10, 20), (1024 * 1024 - 5, 2 * 1024 * 1024 + 5)])
async def test_a_closed_range_gives_exactly_those_bytes(stored, node, first, last):
    response = await fetch(stored, Range=f"bytes={first}-{last}")
    assert response.status_code == 206
    assert response["Content-Range"] == f"bytes {first}-{last}/{len(DATA)}"
    assert response["Content-Length"] == str(last - first + 1)
    assert await body(response) == DATA[first : last + 1]


async def test_a_range_past_the_last_byte_is_cut_at_the_end(stored, node):
    response = await fetch(stored, Range=f"bytes=100-{len(DATA) * 2}")
    assert response.status_code == 206
    assert response["Content-Range"] == f"bytes 100-{len(DATA) - 1}/{len(DATA)}"
    assert await body(response) == DATA[100:]


@pytest.mark.parametrize(
    "header",
    [f"bytes={len(DATA)}-", f"bytes={len(DATA) + 10}-", "bytes=20-10", "bytes=abc", "lines=1-2",
     "bytes=" + "9" * 5000 + "-", "bytes=0-" + "9" * 5000],  # 5,000 digits
)
async def test_an_unsatisfiable_range_is_416(stored, node, header):
    response = await fetch(stored, Range=header)
    assert response.status_code == 416
    assert response["Content-Range"] == f"bytes */{len(DATA)}"


async def test_an_empty_file_has_no_range_to_give(node, tmp_path):
    source = tmp_path / "empty"
    source.write_bytes(b"")
    sha, _, _ = store.store(source)
    await sync_to_async(make_file)("empty", size=0, gguf=False, sha256=sha)
    try:
        response = await fetch(sha)
        assert (response.status_code, response["Content-Length"], await body(response)) == (200, "0", b"")
        response = await fetch(sha, Range="bytes=0-")
        assert (response.status_code, response["Content-Range"]) == (416, "bytes */0")
    finally:
        store.remove(sha)


async def test_an_unknown_file_is_404_json(node):
    sha = hashlib.sha256(b"absent").hexdigest()
    response = await fetch(sha)
    assert response.status_code == 404
    assert response.json() == {"detail": f"no file {sha} in the mirror"}


async def test_a_row_whose_file_is_gone_is_404(stored, node):
    store.remove(stored)
    response = await fetch(stored)
    assert response.status_code == 404


async def test_without_credentials_it_is_401(stored):
    response = await fetch(stored, token=None)
    assert response.status_code == 401
    assert "node token" in response.json()["detail"]
    # An unknown sha says no more than a known one.
    response = await fetch(hashlib.sha256(b"absent").hexdigest(), token=None)
    assert response.status_code == 401


async def test_a_wrong_node_token_is_401(stored, node):
    assert (await fetch(stored, token="lnt_wrong")).status_code == 401
    assert (await fetch(stored, token="")).status_code == 401


async def test_a_viewer_is_401(stored):
    client = await as_user("viewer")
    assert (await fetch(stored, client, token=None)).status_code == 401


@pytest.mark.parametrize("role", ["operator", "admin"])
async def test_operators_and_admins_download(stored, role):
    client = await as_user(role)
    response = await fetch(stored, client, token=None, Range="bytes=7-")
    assert response.status_code == 206
    assert await body(response) == DATA[7:]


async def test_a_control_plane_s_token_opens_it_until_removed_or_replaced(stored, this_control_plane):
    await sync_to_async(make_control_plane)("cp-2")
    mine = peers.token()
    assert [(await fetch(stored, token=t)).status_code for t in ("lcp_cp-2", mine)] == [200, 200]
    await sync_to_async(operations.remove_control_plane)("cp-2", "test")
    await sync_to_async(operations.rotate_control_plane_token)("cp-1", "test")
    assert [(await fetch(stored, token=t)).status_code for t in ("lcp_cp-2", mine, peers.token())] == [401, 401, 200]
