"""Every failure as OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``.

Handlers raise ``ApiError``; werkzeug's HTTP errors (404, 405, 413, ...) and any
unexpected exception are turned into the same shape, so a client never sees an
HTML page or a traceback.
"""

from __future__ import annotations

import json
import logging
import math

from quart import Quart, Response
from werkzeug.exceptions import HTTPException

from spark.actors.ingress import SubmitError

log = logging.getLogger("spark.http")

_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 429: "rate_limit_error"}


class ApiError(Exception):
    """A request failed in a way the client should hear about.

    Args:
      status: the HTTP status.
      message: one line a user can act on.
      param: the request field at fault (``"temperature"``, ``"messages[0].role"``), if one is.
      code: a machine-readable reason (``"model_not_found"``, ``"context_length_exceeded"``).
      retry_after: seconds before retrying makes sense; sent as ``Retry-After``.
    """

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after: float | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.retry_after = status, message, param, code, retry_after

    @classmethod
    def refused(cls, exc: SubmitError, *, param: str | None = None) -> ApiError:
        """A refusal of the actor system or of the slot (``spark.control.slot.Refusal``), as the client hears it."""
        return cls(exc.status, exc.message, param=param, code=exc.code, retry_after=exc.retry_after)

    @classmethod
    def generation_failed(cls, why: str) -> ApiError:
        """A generation that broke off after it started (an error piece, or its stream failed)."""
        return cls(500, f"generation failed: {why}", code="generation_failed")

    def body(self) -> dict:
        kind = _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        headers = {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        return Response(json.dumps(self.body()), status=self.status, headers=headers,
                        content_type="application/json")


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def install(app: Quart) -> None:
    """Make ``app`` answer every error with an OpenAI error object."""

    @app.errorhandler(ApiError)
    async def _api_error(exc: ApiError) -> Response:
        return exc.response()

    @app.errorhandler(HTTPException)
    async def _http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        if status == 404:
            from quart import request

            message = f"no route {request.method} {request.path}"
        elif status == 413:
            message = f"request body too large (at most {app.config['MAX_CONTENT_LENGTH']} bytes)"
        else:
            message = exc.description or exc.name
        response = ApiError(status, message, code=_HTTP_CODES.get(status)).response()
        if status == 413:  # the rest of the body is still on the wire: never reuse this connection
            response.headers["Connection"] = "close"
        if status == 405 and getattr(exc, "valid_methods", None):
            response.headers["Allow"] = ", ".join(exc.valid_methods)
        return response

    @app.errorhandler(Exception)
    async def _unexpected(exc: Exception) -> Response:
        log.exception("unhandled error", exc_info=exc)
        return ApiError(500, f"internal error: {type(exc).__name__}", code="internal_error").response()
