"""The guard: ASGI middleware in front of every endpoint, cheapest checks first.

The Host allowlist (400: a page on another origin that rebinds its DNS name to
this server is refused), the API key (401, constant-time comparison), the
Content-Type of JSON endpoints (415: a web page can post text/plain to a local
server without a preflight), the body's size (413) and the time to send it
(408 past `body_timeout_s`), then the requests in flight (429 with Retry-After
past `max_requests`; /health always answers). A request counts against
`max_requests` only once its body is in, so clients that trickle bodies hold
no one else's place.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress

from specjax.serving.http.errors import APIError, too_large
from specjax.serving.limits import ServerLimits

# The endpoints whose body is JSON (415 for another Content-Type), read by the guard.
JSON_ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
OPEN_PATHS = ("/health",)  # no key needed, never refused as busy
# The names a loopback address answers to; with no allowlist given, a connection
# that arrives at a loopback address takes only these (and that address).
LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
ANY_HOST = "*"  # an allowlist entry: every Host


class Guard:
  """The checks above, before `app` sees the request (see the module doc).

  `allowed_hosts`: the Host names accepted (any port); empty: the local names
  where the connection arrives at a loopback address, else any; "*": any."""

  def __init__(self, app, limits: ServerLimits, api_key: str | None, allowed_hosts):
    self.app, self.limits = app, limits
    self.key = None if not api_key else f"Bearer {api_key}".encode()
    self.hosts = {h.lower() for h in allowed_hosts}
    self.in_flight = 0

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    error = self._refusal(scope)
    if error is None and scope["method"] == "POST" and scope["path"] in JSON_ENDPOINTS:
      try:
        receive = await self._read_body(receive)
      except APIError as e:
        error = e
    if error is None and scope["path"] not in OPEN_PATHS:
      error = self._busy()
    if error is not None:
      response = error.response()
      if error.status in (408, 413):  # the body is not read: the connection cannot be reused
        response.headers["Connection"] = "close"
      return await response(scope, receive, send)
    if scope["path"] in OPEN_PATHS:
      return await self.app(scope, receive, send)
    self.in_flight += 1
    try:
      await self.app(scope, receive, send)
    finally:
      self.in_flight -= 1

  def _refusal(self, scope) -> APIError | None:
    """What the headers alone refuse: Host, key, Content-Type, declared size."""
    headers = {k.lower(): v for k, v in scope["headers"]}
    error = self._host(scope, headers.get(b"host", b"").decode("latin-1").lower())
    if error is not None:
      return error
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
    return None

  def _host(self, scope, host: str) -> APIError | None:
    """400 for a Host header outside the allowlist (the module doc)."""
    allowed = self.hosts or _local_names(scope.get("server"))
    if not allowed or ANY_HOST in allowed:
      return None
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    if name.strip("[]") in allowed or name in allowed:
      return None
    return APIError(400, f"Host {host!r} is not served here (allowed_hosts).", "Host")

  async def _read_body(self, receive):
    """The whole body, read within `max_body_bytes` (413: a chunked body declares
    no length) and `body_timeout_s` (408); returns the `receive` the app reads it
    from (then the client's own, which tells of a disconnect)."""
    timeout = self.limits.body_timeout_s
    try:
      body = await asyncio.wait_for(_receive_body(receive, self.limits), timeout)
    except asyncio.TimeoutError:
      raise APIError(
        408, f"the request body did not arrive within {timeout:g} s (body_timeout_s)."
      ) from None
    replayed = False

    async def replay():
      nonlocal replayed
      if replayed:
        return await receive()
      replayed = True
      return {"type": "http.request", "body": body, "more_body": False}

    return replay

  def _busy(self) -> APIError | None:
    if self.in_flight < self.limits.max_requests:
      return None
    return APIError(
      429,
      f"the server has {self.in_flight} requests in flight (max_requests); try again shortly.",
      retry_after=1,
    )


async def _receive_body(receive, limits: ServerLimits) -> bytes:
  chunks, size = [], 0
  while True:
    message = await receive()
    if message["type"] == "http.disconnect":
      raise APIError(400, "the client closed the connection before its body was in.")
    chunk = message.get("body", b"")
    size += len(chunk)
    if size > limits.max_body_bytes:
      raise too_large(limits)
    chunks.append(chunk)
    if not message.get("more_body", False):
      return b"".join(chunks)


def _local_names(server) -> frozenset[str]:
  """The local names and `server`'s address where it is a loopback address (the
  connection's local end, as ASGI gives it); else none (any Host)."""
  if not server or not isinstance(server[0], str):
    return frozenset()
  try:
    address = ipaddress.ip_address(server[0].split("%")[0])
  except ValueError:
    return frozenset()
  mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 on a dual-stack socket
  if not (address.is_loopback or (mapped is not None and mapped.is_loopback)):
    return frozenset()
  return LOCAL_NAMES | {server[0].lower()}
