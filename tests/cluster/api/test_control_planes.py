"""The REST API for control planes: listed to anyone, removed or given a new token by admins."""

import pytest

from cluster import peers
from tests.factories import make_control_plane, make_file, row_counts
from tests.rest import API, refused


@pytest.fixture
def planes(db, this_control_plane):
    return this_control_plane, make_control_plane("cp-2", holds=(make_file("alone.gguf"),))


def test_a_viewer_sees_each_control_plane_and_which_one_answered(viewer, planes):
    rows = viewer.get(f"{API}/control-planes/").json()["results"]
    assert [(r["name"], r["this"], r["alive"], r["files"], r["rotation_asked_at"]) for r in rows] == [
        ("cp-1", True, True, 0, None), ("cp-2", False, True, 1, None)]


@pytest.mark.parametrize("method, path", [("delete", "cp-2/"), ("post", "cp-2/token/")])
@pytest.mark.parametrize("role", ["viewer", "operator"])
def test_only_an_admin_removes_a_control_plane_or_gives_it_a_new_token(request, planes, role, method, path):
    client = request.getfixturevalue(role)
    before = row_counts()
    refused(getattr(client, method)(f"{API}/control-planes/{path}"), 403)
    assert row_counts() == before and peers.is_peer("lcp_cp-2")


def test_an_admin_removes_one_the_one_answering_only_when_forced(admin, planes):
    refused(admin.delete(f"{API}/control-planes/cp-9/"), 404, "no control plane named 'cp-9'")
    refused(admin.delete(f"{API}/control-planes/cp-2/?force=maybe"), 400, "force")
    response = admin.delete(f"{API}/control-planes/cp-2/")
    assert response.status_code == 200, response.content
    assert response.json() == {"name": "cp-2", "files": 1, "orphaned": ["alone.gguf"], "alive": True}
    assert not peers.is_peer("lcp_cp-2")
    before = row_counts()
    refused(admin.delete(f"{API}/control-planes/cp-1/"), 409, "the one this runs on")
    assert row_counts() == before
    assert admin.delete(f"{API}/control-planes/cp-1/?force=true").status_code == 200
    assert not peers.is_peer(peers.token())


def test_an_admin_gives_a_control_plane_a_new_token(admin, planes):
    other = admin.post(f"{API}/control-planes/cp-2/token/").json()
    assert (other["name"], other["rotated"], other["rotation_asked_at"] is not None) == ("cp-2", False, True)
    old = peers.token()
    here = admin.post(f"{API}/control-planes/cp-1/token/").json()
    assert (here["name"], here["rotated"], here["this"], here["files"]) == ("cp-1", True, True, 0)
    assert not peers.is_peer(old) and peers.is_peer(peers.token())
    refused(admin.post(f"{API}/control-planes/cp-9/token/"), 404, "no control plane named 'cp-9'")
