"""The REST API's own part: who may do what, how a request is parsed. The operations have their own tests."""


import pytest
from rest_framework.test import APIClient

from cluster.models import Node
from tests.factories import client_for, make_node, make_user, row_counts
from tests.rest import API, refused

# Authentication and roles

LISTS = ["nodes", "models", "replicas", "profiles", "engines", "model-files", "events", "status"]


@pytest.mark.parametrize("resource", LISTS)
def test_anonymous_gets_401_with_a_challenge(db, resource):
    response = APIClient().get(f"{API}/{resource}/")
    assert response.status_code == 401
    assert response["WWW-Authenticate"] == "Bearer"


def test_anonymous_write_gets_401_and_changes_nothing(db):
    before = row_counts()
    assert APIClient().post(f"{API}/nodes/", {"name": "gpu-9"}, format="json").status_code == 401
    assert row_counts() == before


@pytest.mark.parametrize("scheme", ["Bearer", "Token", "bearer"])
def test_token_schemes(db, scheme):
    assert client_for("viewer", scheme=scheme).get(f"{API}/nodes/").status_code == 200


@pytest.mark.parametrize("header", ["Bearer nope", "Bearer a b", "Token nope", "Bearer"])
def test_bad_tokens_get_401(db, header):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=header)
    assert client.get(f"{API}/nodes/").status_code == 401


def test_session_login_works(db):
    user, _ = make_user("viewer")
    client = APIClient()
    client.force_login(user)
    assert client.get(f"{API}/models/").status_code == 200


def test_user_without_a_role_may_not_look(db):
    from django.contrib.auth.models import User

    client = APIClient()
    client.force_login(User.objects.create(username="nobody"))
    assert client.get(f"{API}/models/").status_code == 403


WRITES = [
    ("post", "nodes/", {"name": "gpu-9"}),
    ("delete", "nodes/gpu-1/?force=true", None),
    ("post", "models/", {"name": "new", "file": "qwen.gguf", "engine": "llama.cpp"}),
    ("patch", "models/qwen2.5-7b/", {"replicas": 2}),
    ("put", "models/qwen2.5-7b/", {"replicas": 2}),
    ("delete", "models/qwen2.5-7b/", None),
    ("post", "profiles/", {"name": "long"}),
    ("patch", "profiles/default/", {"context_size": 8192}),
    ("delete", "profiles/spare/", None),
    ("post", "engines/", {"name": "vllm-2", "kind": "vllm"}),
    ("post", "model-files/", {"path": "/etc/hostname"}),
    ("post", "users/", {"name": "eve", "role": "admin"}),
]


@pytest.mark.parametrize("method, path, body", WRITES)
def test_viewer_may_not_write(cluster, viewer, method, path, body):
    before = row_counts()
    response = getattr(viewer, method)(f"{API}/{path}", body, format="json")
    refused(response, 403, "role")
    assert row_counts() == before


@pytest.mark.parametrize("method, path, body", WRITES)
def test_anonymous_may_not_write(cluster, method, path, body):
    before = row_counts()
    assert getattr(APIClient(), method)(f"{API}/{path}", body, format="json").status_code == 401
    assert row_counts() == before


def test_bad_json_is_a_400(operator):
    response = operator.post(f"{API}/nodes/", "{not json", content_type="application/json")
    refused(response, 400, "JSON parse error")


@pytest.mark.parametrize("path", ["nodes/", "models/", "restart/", "settings/"])
def test_json_nested_too_deep_is_a_400_not_a_500(admin, path):
    deep = '{"name": ' + "[" * 100_000 + "]" * 100_000 + "}"
    method = admin.patch if path == "settings/" else admin.post
    refused(method(f"{API}/{path}", deep, content_type="application/json"), 400, "nested too deeply")


def test_a_body_that_is_neither_json_nor_an_upload_is_a_415(operator):
    response = operator.post(f"{API}/nodes/", "name=gpu-1", content_type="application/x-www-form-urlencoded")
    refused(response, 415, "Unsupported media type")
    assert not Node.objects.exists()


@pytest.mark.parametrize("body", [[], ["gpu-1"], "gpu-1", 5, None])
def test_a_body_that_is_not_an_object_is_a_400(operator, body):
    response = operator.post(f"{API}/nodes/", body, format="json")
    assert response.status_code == 400
    assert not Node.objects.exists()


def test_unknown_field_is_a_400(cluster, operator):
    before = row_counts()
    refused(operator.patch(f"{API}/models/qwen2.5-7b/", {"replica": 2}, format="json"), 400, "replica", "unknown")
    assert row_counts() == before


LISTED = ["nodes", "models", "replicas", "profiles", "engines", "model-files", "events", "keys", "usage"]


@pytest.mark.parametrize("resource", LISTED)
@pytest.mark.parametrize(
    "query, field",
    [
        ("limit=9223372036854775808", "limit"),
        ("offset=9223372036854775808", "offset"),
        ("limit=99999999999999999999999999999", "limit"),
        ("limit=-1", "limit"),
        ("limit=0", "limit"),
        ("limit=10001", "limit"),
        ("limit=abc", "limit"),
        ("offset=null", "offset"),
        ("offset=", "offset"),
        ("offset=1e3", "offset"),
        ("limit=%EF%BC%91", "limit"),  # a full-width digit: isdigit() says yes, int() would take it
    ],
)
def test_out_of_range_or_malformed_paging_is_a_400_never_a_500(admin, resource, query, field):
    refused(admin.get(f"{API}/{resource}/?{query}"), 400, field, "whole number")


def test_paging_within_range_pages(admin):
    for i in range(3):
        make_node(f"page-{i}")
    page = admin.get(f"{API}/nodes/?limit=2&offset=1").json()
    assert page["count"] == 3 and [n["name"] for n in page["results"]] == ["page-1", "page-2"]
    assert admin.get(f"{API}/nodes/?limit=10000&offset=1000000000").json()["results"] == []
