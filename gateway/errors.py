"""OpenAI-shaped errors: {"error": {"message", "type", "code"}}. Never a 500, never an HTML page."""

import json
from typing import NotRequired, TypedDict

from gateway.http import Answer, json_answer
from gateway.tracing import current_id

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    502: "api_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class ErrorFields(TypedDict):
    message: str
    type: str
    code: str


class ErrorBody(TypedDict):
    error: ErrorFields
    request_id: NotRequired[str]  # the request's (gateway/tracing.py), where it has one


class GatewayError(Exception):
    exhausted_until: int | None = None  # a budget's refusal: when the budget it used up resets (gateway/spend.py)

    def __init__(self, status: int, code: str, message: str, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.retry_after = status, code, message, retry_after

    def response(self) -> Answer:
        return error_response(self.status, self.code, self.message, self.retry_after)

    def event(self) -> bytes:
        """The same error as a server-sent event, for a stream that already began."""
        return f"data: {json.dumps(_body(self.status, self.code, self.message))}\n\n".encode()


def _body(status: int, code: str, message: str) -> ErrorBody:
    body: ErrorBody = {"error": {"message": message, "type": TYPES.get(status, "api_error"), "code": code}}
    if rid := current_id.get():
        body["request_id"] = rid
    return body


def error_response(status: int, code: str, message: str, retry_after: int | None = None) -> Answer:
    answer = json_answer(_body(status, code, message), status)
    if retry_after is not None:
        answer["Retry-After"] = str(max(1, int(retry_after)))
    return answer


def invalid(message: str) -> GatewayError:
    return GatewayError(400, "invalid_request", message)
