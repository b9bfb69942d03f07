"""The OpenAPI schema: generated without warnings, valid, and covering every endpoint."""

import pytest
from drf_spectacular.drainage import GENERATOR_STATS
from drf_spectacular.generators import SchemaGenerator
from openapi_spec_validator import validate
from rest_framework.test import APIClient

from tests.factories import make_user


@pytest.fixture
def schema():
    GENERATOR_STATS.reset()
    generated = SchemaGenerator().get_schema(request=None, public=True)
    return generated


def test_schema_is_valid_openapi(schema):
    validate(schema)


def test_schema_generates_without_warnings_or_errors(schema):
    assert not GENERATOR_STATS._warn_cache, sorted(GENERATOR_STATS._warn_cache)
    assert not GENERATOR_STATS._error_cache, sorted(GENERATOR_STATS._error_cache)


def test_schema_covers_every_endpoint(schema):
    operations = {
        (path, method) for path, methods in schema["paths"].items() for method in methods if method != "parameters"
    }
    expected = {
        ("/api/v1/nodes/", "get"),
        ("/api/v1/nodes/", "post"),
        ("/api/v1/nodes/{name}/", "get"),
        ("/api/v1/nodes/{name}/", "delete"),
        ("/api/v1/models/", "get"),
        ("/api/v1/models/", "post"),
        ("/api/v1/models/{name}/", "get"),
        ("/api/v1/models/{name}/", "put"),
        ("/api/v1/models/{name}/", "patch"),
        ("/api/v1/models/{name}/", "delete"),
        ("/api/v1/replicas/", "get"),
        ("/api/v1/replicas/{name}/", "get"),
        ("/api/v1/profiles/", "get"),
        ("/api/v1/profiles/", "post"),
        ("/api/v1/profiles/{name}/", "get"),
        ("/api/v1/profiles/{name}/", "put"),
        ("/api/v1/profiles/{name}/", "patch"),
        ("/api/v1/profiles/{name}/", "delete"),
        ("/api/v1/engines/", "get"),
        ("/api/v1/engines/", "post"),
        ("/api/v1/engines/{name}/", "get"),
        ("/api/v1/engines/{name}/", "put"),
        ("/api/v1/engines/{name}/", "patch"),
        ("/api/v1/model-files/", "get"),
        ("/api/v1/control-planes/", "get"),
        ("/api/v1/control-planes/{name}/", "delete"),
        ("/api/v1/control-planes/{name}/token/", "post"),
        ("/api/v1/model-files/", "post"),
        ("/api/v1/model-files/{sha256}/", "get"),
        ("/api/v1/events/", "get"),
        ("/api/v1/status/", "get"),
        ("/api/v1/users/", "get"),
        ("/api/v1/users/", "post"),
        ("/api/v1/keys/", "get"),
        ("/api/v1/keys/", "post"),
        ("/api/v1/keys/{name}/", "get"),
        ("/api/v1/keys/{name}/", "put"),
        ("/api/v1/keys/{name}/", "patch"),
        ("/api/v1/keys/{name}/revoke/", "post"),
        ("/api/v1/usage/", "get"),
        ("/api/v1/requests/", "get"),
        ("/api/v1/requests/{request_id}/", "get"),
        ("/api/v1/system/stop/", "post"),
        ("/api/v1/system/start/", "post"),
        ("/api/v1/system/restart/", "post"),
        ("/api/v1/system/status/", "get"),
        ("/api/v1/restart/", "post"),
        ("/api/v1/nodes/{name}/drain/", "post"),
        ("/api/v1/nodes/{name}/undrain/", "post"),
        ("/api/v1/engine-key/rotate/", "post"),
        ("/api/v1/engine-key/", "get"),
        ("/api/v1/settings/", "get"),
        ("/api/v1/settings/", "patch"),
        ("/api/v1/me/", "get"),
        ("/api/v1/login/", "post"),
        ("/api/v1/nodes/{name}/token/", "post"),
        ("/api/v1/models/{name}/rollout/", "get"),
        ("/api/v1/models/{name}/rollout/", "post"),
        ("/api/v1/models/{name}/rollout/promote/", "post"),
        ("/api/v1/models/{name}/rollout/abort/", "post"),
        ("/api/v1/rollouts/", "get"),
    }
    assert operations == expected


def test_schema_describes_writes_and_their_refusals(schema):
    create = schema["paths"]["/api/v1/models/"]["post"]
    request = create["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    component = schema["components"]["schemas"][request.rsplit("/", 1)[1]]
    assert set(component["required"]) == {"name", "file", "engine"}
    assert component["properties"]["replicas"]["minimum"] == 0
    # every answer a client can get is documented: schemathesis (tests/integration/test_fuzz.py) holds us to it
    assert set(create["responses"]) == {"201", "400", "401", "403", "409", "415", "422", "429"}
    assert set(schema["paths"]["/api/v1/models/{name}/"]["delete"]["responses"]) == {
        "202", "401", "403", "404", "409", "422", "429"
    }
    assert set(schema["paths"]["/api/v1/events/"]["get"]["responses"]) == {"200", "400", "401", "403", "429"}
    # what the API refuses, the schema refuses: no unknown fields, names by their pattern, no NUL in text
    assert component["additionalProperties"] is False
    assert component["properties"]["name"]["pattern"] == r"^[a-z0-9][a-z0-9._\-]{0,62}$"  # as a browser's pattern
    assert component["properties"]["engine"]["pattern"] == "^[^\\x00]*$"
    settings = schema["paths"]["/api/v1/settings/"]["patch"]["requestBody"]
    assert settings["required"] is True  # an empty PATCH is refused: it would change nothing
    assert schema["components"]["securitySchemes"]["bearerAuth"] == {
        "type": "http",
        "scheme": "bearer",
        "description": schema["components"]["securitySchemes"]["bearerAuth"]["description"],
    }


def test_schema_endpoint_serves_the_same_schema(db):
    _, token = make_user("viewer")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    response = client.get("/api/v1/schema/?format=json")
    assert response.status_code == 200
    served = response.json()
    validate(served)
    assert set(served["paths"]) >= {"/api/v1/models/", "/api/v1/status/"}


def test_schema_gives_a_keys_log_bodies_as_a_boolean_never_required(schema):
    components = schema["components"]["schemas"]
    for path, method in (("/api/v1/keys/", "post"), ("/api/v1/keys/{name}/", "put"), ("/api/v1/keys/{name}/", "patch")):
        request = schema["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        component = components[request.rsplit("/", 1)[1]]
        assert component["properties"]["log_bodies"]["type"] == "boolean"
        assert "LLMGW_REQUEST_LOG_BODY_BYTES" in component["properties"]["log_bodies"]["description"]
        assert "log_bodies" not in component.get("required", [])  # left out: off when created, unchanged when set
    assert components["ApiKey"]["properties"]["log_bodies"]["type"] == "boolean"
