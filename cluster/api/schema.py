"""What the OpenAPI schema says beyond the serializers: how a client authenticates and what an error looks like."""

from __future__ import annotations

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.utils import OpenApiResponse
from rest_framework import serializers


class BearerTokenScheme(OpenApiAuthenticationExtension):
    target_class = "cluster.permissions.BearerTokenAuthentication"
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


REFUSED = {
    400: OpenApiResponse(
        ErrorSerializer, description='refused: `{"detail": "why"}`, or `{"field": ["why"]}` for a malformed field'
    )
}
MISSING = {404: OpenApiResponse(ErrorSerializer, description="no object by that name")}
