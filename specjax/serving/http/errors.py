"""The API's error: OpenAI's `{"error": {"message", "type", "param"}}` with its status,
and the app's handlers that answer every failure in that shape."""

from __future__ import annotations

import logging
import math

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from specjax.serving.limits import ServerLimits
from specjax.serving.request import Event

logger = logging.getLogger(__name__)


class APIError(Exception):
  """An error answered as `{"error": {"message", "type", "param"}}`; `retry_after`
  (seconds) adds a Retry-After header (429, 503)."""

  def __init__(
    self,
    status: int,
    message: str,
    param: str | None = None,
    kind: str | None = None,
    retry_after: float | None = None,
  ):
    super().__init__(message)
    self.status, self.message, self.param = status, message, param
    self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    self.retry_after = retry_after

  def response(self) -> JSONResponse:
    headers = None
    if self.retry_after is not None:
      headers = {"Retry-After": str(max(1, math.ceil(self.retry_after)))}
    if self.status == 401:
      headers = {"WWW-Authenticate": "Bearer"}
    return JSONResponse(self.body(), status_code=self.status, headers=headers)

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.kind, "param": self.param}}


def too_large(limits: ServerLimits) -> APIError:
  return APIError(413, f"the request body exceeds {limits.max_body_bytes} bytes (max_body_bytes).")


def finish_error(event: Event) -> APIError | None:
  """The error a request that ended without completing is answered with."""
  if event.finish_reason == "error":
    return APIError(500, f"generation failed: {event.error}")
  if event.finish_reason == "cancelled":  # by the server: it is shutting down
    return APIError(503, "the request was cancelled: the server is shutting down.")
  return None


async def api_error(_, error: APIError):
  return error.response()


async def http_error(_, error: HTTPException):  # 404 / 405 in the same shape
  return APIError(error.status_code, str(error.detail)).response()


async def server_error(_, error: Exception):  # a bug: still the API's shape, and logged
  logger.error("request failed", exc_info=error)
  return APIError(500, f"internal error: {type(error).__name__}").response()
