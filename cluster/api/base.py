"""What every REST API resource stands on, in either app (cluster.api, gateway.api): strict input serializers,
viewsets that look objects up by name, and query parameters parsed into 400s instead of 500s."""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

from django.utils import timezone
from django.utils.dateparse import parse_datetime
from drf_spectacular.utils import extend_schema_field
from rest_framework import exceptions, serializers, status, viewsets
from rest_framework.response import Response

from cluster.clients import CLI_ACTOR, IN_PROCESS
from cluster.models import ALIAS_PATTERN, NAME_HINT, NAME_RE, USER_NAME_HINT, USER_NAME_PATTERN
from cluster.operations import OperationError, check_alias

INT_MAX = 2**31 - 1  # PostgreSQL's integer: a bigger number must be a 400 here, not a database error
BIGINT_MAX = 2**63 - 1


NO_NUL = r"^[^\x00]*$"  # what a text field takes: anything but NUL, which no database column holds
USER_NAME_RE = rf"^{USER_NAME_PATTERN}$"


@extend_schema_field({"type": "string", "pattern": NAME_RE, "maxLength": 63})
class NameField(serializers.CharField):
    """A name of llmgw's (node, model, profile, engine, key): lower-case letters, digits, `.`, `_`, `-`, as the
    schema's pattern says, checked whole (no trailing newline) and never trimmed into shape."""

    pattern = NAME_RE
    message = f"use {NAME_HINT}"

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("max_length", 63)
        super().__init__(trim_whitespace=False, **kwargs)

    def to_internal_value(self, data):
        value = super().to_internal_value(data)
        if not re.fullmatch(self.pattern, value):
            raise serializers.ValidationError(self.message)
        return value


@extend_schema_field({"type": "string", "pattern": USER_NAME_RE, "maxLength": 150})
class UserNameField(NameField):
    pattern = USER_NAME_RE
    message = f"use {USER_NAME_HINT}"

    def __init__(self, **kwargs):
        super().__init__(max_length=150, **kwargs)


@extend_schema_field({"type": "string", "pattern": rf"^{ALIAS_PATTERN}$", "maxLength": 128})
class AliasField(NameField):
    """Another name a model answers to on /v1/, as clients send it: the operation's check_alias (ALIAS_PATTERN)."""

    def __init__(self, **kwargs):
        super().__init__(max_length=128, **kwargs)

    def to_internal_value(self, data):
        value = serializers.CharField.to_internal_value(self, data)
        try:  # which one, as the operation says it: a list has many
            check_alias(value)
        except OperationError as exc:
            raise serializers.ValidationError(str(exc)) from None
        return value


def _wrong_type(field, value) -> str:
    """Why a JSON value is not of the field's type ("" when it is). DRF itself would take 5 for a string,
    "5" for an integer and 1 for true, which the schema does not."""
    if value is None:
        return "" if field.allow_null else "may not be null"
    if isinstance(field, serializers.ListField):
        if not isinstance(value, list):
            return "must be a list"
        return next((f"item {i}: {why}" for i, item in enumerate(value) for why in [_wrong_type(field.child, item)]
                     if why), "")
    if isinstance(field, serializers.BooleanField):
        return "" if isinstance(value, bool) else "must be true or false"
    if isinstance(field, serializers.IntegerField):
        whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        return "" if whole and not isinstance(value, bool) else "must be a whole number"
    if isinstance(field, (serializers.CharField, serializers.ChoiceField, serializers.DateTimeField)):
        return "" if isinstance(value, str) else "must be a string"
    return ""


class StrictSerializer(serializers.Serializer):
    """An input serializer that refuses fields it does not know, so a typo is not silently ignored (the schema
    says so: `additionalProperties: false`). Its text fields are taken as sent: never trimmed, so what the
    schema allows is what is checked."""

    def get_fields(self):
        fields = super().get_fields()
        for field in fields.values():
            for text in (field, getattr(field, "child", None)):
                if isinstance(text, serializers.CharField):
                    text.trim_whitespace = False
        return fields

    def to_internal_value(self, data):
        if isinstance(data, dict) and not hasattr(data, "getlist"):  # JSON, not a form: its types are the schema's
            wrong = {name: [why] for name, field in self.fields.items() if name in data
                     for why in [_wrong_type(field, data[name])] if why}
            if wrong:
                raise serializers.ValidationError(wrong)
        return super().to_internal_value(data)

    def validate(self, attrs):
        unknown = sorted(set(self.initial_data) - set(self.fields))
        if unknown:
            raise serializers.ValidationError({k: ["unknown field"] for k in unknown})
        return attrs


class NamedViewSet(viewsets.GenericViewSet):
    """A resource looked up by its name (or another unique field), whose 404 names what was asked for."""

    lookup_field = "name"
    # Any segment reaches the view, so an unknown or malformed name gets a JSON 404 naming it.
    lookup_value_regex = "[^/]+"
    missing = "no {value!r}"  # the 404's message

    @property
    def actor(self) -> str:
        return actor_of(self.request)

    def parsed(self, serializer_class) -> dict:
        serializer = serializer_class(data=self.request.data)
        serializer.is_valid(raise_exception=True)
        return dict(serializer.validated_data)

    def get_object(self) -> Any:
        value = self.kwargs[self.lookup_url_kwarg or self.lookup_field]
        obj = self.get_queryset().filter(**{self.lookup_field: value}).first()
        if obj is None:
            raise exceptions.NotFound(self.missing.format(value=value))
        self.check_object_permissions(self.request, obj)
        return obj

    def shown(self, obj, status_code=status.HTTP_200_OK) -> Response:
        """The object as a GET would show it, read again so annotations are there."""
        fresh = self.get_queryset().get(pk=obj.pk)
        return Response(self.get_serializer(fresh).data, status=status_code)


def actor_of(request) -> str:
    """Who a request's changes are recorded as: `user:<name>`, or `cli` for the `llmgw` command on the control
    plane's own host (cluster.api.permissions.InProcessAuthentication)."""
    if request.auth == IN_PROCESS:
        return CLI_ACTOR
    return f"user:{request.user.username}"


def text_param(request, name: str, required_text: bool = False) -> str | None:
    """A text query parameter as given (None when absent): a NUL in it, which no column holds, is a 400, and
    so is an empty one where a name is wanted."""
    raw = request.query_params.get(name)
    if raw is None:
        return None
    if "\x00" in raw:
        raise serializers.ValidationError({name: ["may not contain a NUL character"]})
    if required_text and not raw:
        raise serializers.ValidationError({name: [f"name a {name}"]})
    return raw


def flag_param(request, name: str) -> bool:
    raw = request.query_params.get(name)
    if raw is None:
        return False
    try:
        return serializers.BooleanField().to_internal_value(raw)
    except serializers.ValidationError:
        raise serializers.ValidationError({name: [f"must be true or false, not {raw!r}"]}) from None


def datetime_param(name: str, raw: str):
    try:
        value = parse_datetime(raw.strip())
    except ValueError:  # well formed but impossible, e.g. month 13
        value = None
    if value is None:
        raise serializers.ValidationError(
            {name: [f"must be an ISO 8601 date and time, e.g. 2025-01-31T12:00:00Z, not {raw!r}"]}
        )
    if timezone.is_naive(value):
        value = timezone.make_aware(value)
    try:  # in UTC: the database takes no offset beyond ±15:59, which ISO 8601 allows
        return value.astimezone(dt.UTC)
    except OverflowError:  # the first or last moment Python knows, moved past the edge by its offset
        edge = dt.datetime.min if value.year == 1 else dt.datetime.max
        return edge.replace(tzinfo=dt.UTC)



def int_param(name: str, raw: str) -> int:
    """A whole-number query parameter (0 to 2^63 - 1), else a 400 naming it."""
    text = raw.strip()
    if not (text.isascii() and text.isdigit() and len(text) <= 19 and int(text) <= BIGINT_MAX):
        raise serializers.ValidationError({name: [f"must be a whole number from 0 to {BIGINT_MAX}, not {raw[:40]!r}"]})
    return int(text)
