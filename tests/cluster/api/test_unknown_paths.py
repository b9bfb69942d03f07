"""A path under /api/ that no endpoint answers is a 404 in the API's JSON, never Django's HTML page: by any method,
for anyone, with DEBUG on or off (cluster.api.views.NoSuchPathView)."""

import pytest
from django.test import Client

from tests.factories import client_for

PATHS = ["/api/v1/nope/", "/api/v1/nope", "/api/v1/nope/deeper/still/", "/api/v1/models/x/y/z/",
         "/api/v1/nodes/gpu-1/drain/now/", "/api/v2/nodes/", "/api/", "/api"]


@pytest.mark.parametrize("debug", [False, True], ids=["debug-off", "debug-on"])
@pytest.mark.parametrize("who", [None, "viewer", "admin"], ids=["anonymous", "viewer", "admin"])
@pytest.mark.parametrize("method", ["get", "post", "put", "patch", "delete", "head", "options", "PROPFIND"])
def test_an_unknown_path_is_a_json_404(db, settings, debug, who, method):
    settings.DEBUG = debug
    client = client_for(who)
    for path in PATHS:
        answer = client.generic(method.upper(), path)
        assert answer.status_code == 404, (path, answer.content[:200])
        assert answer["Content-Type"] == "application/json", (path, answer.content[:200])
        if method != "head":
            assert answer.json() == {"detail": f"no API endpoint at {path}"}


def test_a_wrong_token_on_an_unknown_path_is_no_guess(db, settings):
    """Nothing is authenticated there, so nothing is learnt of a token, and nothing counted (cluster/throttle.py)."""
    settings.LLMGW_AUTH_FREE_FAILURES = 1
    client = client_for(None)
    client.credentials(HTTP_AUTHORIZATION="Bearer not-a-token")
    for _ in range(3):
        assert client.get("/api/v1/nope/").status_code == 404
    assert client.get("/api/v1/nodes/").status_code == 401  # the first counted failure, not the fourth


def test_a_path_that_lacks_only_its_slash(db, settings):
    """A GET is sent to the path with the slash, as Django's APPEND_SLASH does; a POST, which cannot follow a
    redirect with its body, is told where it meant."""
    settings.DEBUG = True  # Django's own APPEND_SLASH raises on a POST then: a 500
    client = client_for("admin")
    answer = client.get("/api/v1/models?limit=1")
    assert (answer.status_code, answer["Location"]) == (301, "/api/v1/models/?limit=1")
    answer = client.post("/api/v1/profiles", {"name": "p"}, format="json")
    assert answer.status_code == 404
    assert answer.json() == {"detail": "no API endpoint at /api/v1/profiles: did you mean /api/v1/profiles/?"}
    assert client.get("/api/v1/schema").status_code == 301
    # the known paths are as they were
    assert client.get("/api/v1/").status_code == 200
    assert client.get("/api/v1/models/").status_code == 200
    assert client.get("/api/v1/models/no-such-model/").json() == {"detail": "no model named 'no-such-model'"}
    assert client_for(None).get("/api/v1/models/").status_code in (401, 403)  # still wants a token


def test_the_pages_outside_the_api_keep_their_html_404(db):
    answer = Client().get("/no-such-page/")
    assert answer.status_code == 404 and answer["Content-Type"].startswith("text/html")
