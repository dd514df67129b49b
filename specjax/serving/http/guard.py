"""The guard: ASGI middleware in front of every endpoint, cheapest checks first.

The Host allowlist (400), the API key (401, constant-time comparison), the
Content-Type of JSON endpoints (415: a web page can post text/plain to a local
server without a preflight), the declared body size (413) and the requests in
flight (429 with Retry-After past `max_requests`; /health always answers).
"""

from __future__ import annotations

import hmac

from specjax.serving.http.errors import APIError, too_large
from specjax.serving.limits import ServerLimits

# The endpoints whose body is JSON (415 for another Content-Type).
JSON_ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
OPEN_PATHS = ("/health",)  # no key needed, never refused as busy


class Guard:
  """The checks above, before `app` sees the request (see the module doc).

  `allowed_hosts`: the Host names accepted (any port); empty: any."""

  def __init__(self, app, limits: ServerLimits, api_key: str | None, allowed_hosts):
    self.app, self.limits = app, limits
    self.key = None if not api_key else f"Bearer {api_key}".encode()
    self.hosts = {h.lower() for h in allowed_hosts}
    self.in_flight = 0

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    error = self._refusal(scope)
    if error is not None:
      return await error.response()(scope, receive, send)
    if scope["path"] in OPEN_PATHS:
      return await self.app(scope, receive, send)
    self.in_flight += 1
    try:
      await self.app(scope, receive, send)
    finally:
      self.in_flight -= 1

  def _refusal(self, scope) -> APIError | None:
    headers = {k.lower(): v for k, v in scope["headers"]}
    if self.hosts:
      host = headers.get(b"host", b"").decode("latin-1").lower()
      name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
      if name.strip("[]") not in self.hosts and name not in self.hosts:
        return APIError(400, f"Host {host!r} is not served here (allowed_hosts).", "Host")
    path = scope["path"]
    if self.key is not None and path not in OPEN_PATHS:
      given = headers.get(b"authorization", b"")
      if not hmac.compare_digest(given, self.key):
        what = "a wrong key" if given else "no Authorization header"
        return APIError(
          401, f"this server needs an API key (Authorization: Bearer <key>); got {what}.",
          kind="authentication_error",
        )  # fmt: skip
    if scope["method"] == "POST" and path in JSON_ENDPOINTS:
      media = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
      if media != b"application/json":
        return APIError(
          415,
          f"the body must be Content-Type: application/json, got "
          f"{media.decode('latin-1') or 'none'!r}.",
          "Content-Type",
        )
      length = headers.get(b"content-length", b"0")
      if length.isdigit() and (len(length) > 18 or int(length) > self.limits.max_body_bytes):
        return too_large(self.limits)
    if path not in OPEN_PATHS and self.in_flight >= self.limits.max_requests:
      return APIError(
        429,
        f"the server has {self.in_flight} requests in flight (max_requests); try again shortly.",
        retry_after=1,
      )
    return None


async def read_body(http_request, limits: ServerLimits) -> bytes:
  """The body, read up to `max_body_bytes` (413 past it: a chunked body declares no length)."""
  chunks, size = [], 0
  async for chunk in http_request.stream():
    size += len(chunk)
    if size > limits.max_body_bytes:
      raise too_large(limits)
    chunks.append(chunk)
  return b"".join(chunks)
