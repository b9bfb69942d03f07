"""What the OpenAPI schema says beyond the serializers: how a client authenticates, and every way a request
is refused (cluster.api.errors), so that the schema is what the API does:

- every operation documents 401, 403 and 429 (a throttled address, cluster/throttle.py); one with a body or
  query parameters 400 (`FieldErrors`), one with a path parameter 404, one that changes something 409 and
  422, one with a body 415;
- a request body is exactly its fields (`additionalProperties: false`), and a text field or query parameter
  holds no NUL;
- what else a component needs said (minProperties) is in EXTRA.
"""

from __future__ import annotations

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.utils import OpenApiResponse
from rest_framework import serializers

from cluster.api.base import NO_NUL

WRITES = ("post", "put", "patch", "delete")
METHODS = ("get", *WRITES)
EXTRA = {
    "ClusterSettingsUpdateRequest": {"minProperties": 1},
    "PatchedClusterSettingsUpdateRequest": {"minProperties": 1},
}


class BearerTokenScheme(OpenApiAuthenticationExtension):
    target_class = "cluster.api.permissions.BearerTokenAuthentication"
    name = "bearerAuth"
    priority = 1

    def get_security_definition(self, auto_schema):
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "a user's API token: `Authorization: Bearer <token>` (`Token <token>` works too)",
        }


class ErrorSerializer(serializers.Serializer):
    detail = serializers.CharField()


# a filter naming something that does not exist (`?model=`, `?node=`, `?key=`): a typo is not an empty list
UNKNOWN_FILTER = {422: OpenApiResponse(ErrorSerializer, description="a filter names something that does not exist")}

DETAIL = {"$ref": "#/components/schemas/Error"}
FIELD_ERRORS = {
    "type": "object",
    "description": 'what is malformed: `{"field": ["why"]}` (`{"field": {"0": ["why"]}}` for an item of a list, '
    '`non_field_errors` for the whole body), or `{"detail": "why"}` for a body that is not JSON',
    "properties": {"detail": {"type": "string"}},
    "additionalProperties": {
        "anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "object"}],
    },
}
STANDARD = {
    "400": ("FieldErrors", "a malformed field or parameter: what the schema refuses"),
    "401": ("Error", "no credentials, or a wrong or unknown token"),
    "403": ("Error", "the role may not: a viewer only looks, some operations are the admin's"),
    "404": ("Error", "nothing by that name (the path's)"),
    "409": ("Error", "in conflict with the cluster as it is: a name taken, in use, being removed, already so"),
    "415": ("Error", "a body that is not JSON (model files also take multipart/form-data)"),
    "422": ("Error", "well formed, refused for a reason the schema cannot say: it names something that does "
                     "not exist, a file unfit for the engine, a time in the past"),
    "429": ("Error", "too many failed API tokens from this address: `Retry-After` says when to try again"),
}


def _response(name: str, description: str) -> dict:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}}


def _no_nul(schema: dict) -> None:
    if schema.get("type") == "string" and not ({"pattern", "enum", "format"} & set(schema)):
        schema["pattern"] = NO_NUL
    if schema.get("type") == "array" and isinstance(schema.get("items"), dict):
        _no_nul(schema["items"])


def document_refusals(result, generator, request, public):
    """drf-spectacular's postprocessing hook (SPECTACULAR_SETTINGS)."""
    schemas = result.setdefault("components", {}).setdefault("schemas", {})
    schemas["FieldErrors"] = FIELD_ERRORS
    schemas.setdefault("Error", {"type": "object", "properties": {"detail": {"type": "string"}},
                                 "required": ["detail"]})
    for path, operations in result.get("paths", {}).items():
        for method, operation in operations.items():
            if method not in METHODS:
                continue
            query = [p for p in operation.get("parameters", []) if p.get("in") == "query"]
            for parameter in query:
                _no_nul(parameter.get("schema", {}))
            wanted = ["401", "403", "429"]
            if "requestBody" in operation or query:
                wanted.append("400")
            if "requestBody" in operation:
                wanted.append("415")
            if "{" in path:
                wanted.append("404")
            if method in WRITES:
                wanted += ["409", "422"]
            body = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
            if EXTRA.get(body.get("$ref", "").rsplit("/", 1)[-1], {}).get("minProperties"):
                operation["requestBody"]["required"] = True  # a body is needed to say what to change
            responses = operation.setdefault("responses", {})
            for status in wanted:
                responses.setdefault(status, _response(*STANDARD[status]))
    for name, schema in schemas.items():
        if not name.endswith("Request") or schema.get("type") != "object":
            continue
        schema["additionalProperties"] = False
        for field in schema.get("properties", {}).values():
            _no_nul(field)
        schema.update(EXTRA.get(name, {}))
    return result
