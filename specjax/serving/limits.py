"""What the HTTP server bounds, so that no request can stall, starve or crash it.

Every limit has a default a deployment may raise (configs/serve.py's field of
the same name); a request past one gets an OpenAI-style error whose `param`
names the field: 400, 408 (a body not sent in time), 413 (the body), 415 (its
Content-Type), 429 (a full queue or every slot of a concurrency cap in use,
with Retry-After).
docs/serving.md ("Limits and security") lists them.
"""

from __future__ import annotations

import dataclasses

from specjax.validation import check_int


@dataclasses.dataclass(frozen=True)
class ServerLimits:
  """The server's bounds on requests (see the module doc).

  Attributes:
    max_body_bytes: a request body's bytes at most (413).
    max_json_depth: the body's JSON nesting at most (400).
    max_requests: HTTP requests in flight at once, /health aside (429).
    max_stop_chars: each stop string's characters at most (400 naming `stop`).
    max_regex_chars: `guided_regex`'s characters at most.
    max_regex_repeat: the copies a counted repetition makes of one piece, nested
      counts multiplied (`a{300}` makes 300; `specjax.grammar.regex_repeat`);
      also checked on a schema's regex.
    max_schema_bytes, max_schema_depth: a JSON schema's bytes (as JSON) and nesting.
    max_choices, max_choice_chars: `guided_choice`'s options, and their
      characters together.
    max_tools: the functions a chat request's `tools` may offer (each one's
      parameters schema is bounded as a schema).
    compile_workers: constraints compiled at once, each in a worker process.
    compile_queue: compiles that may wait for a worker; past it, 429.
    compile_per_client: compiles one client may have started and not finished
      (running or waiting), from 1 to compile_workers + compile_queue; past it,
      that client gets 429 while others are still served (below
      compile_workers, no client can hold every worker). A request for a
      constraint already compiling awaits that compile and takes no share.
      Clients are told apart by what the HTTP side passes (the peer's address:
      behind a proxy, every client is the proxy).
    compile_timeout_s: a compile's seconds at most (its worker is killed).
    compile_memory_mb: a compile worker's address space, MiB (0: no limit).
    compile_cache_mb: the compiled automata kept for reuse, MiB.
    request_timeout_s: a request's seconds from arrival to its last token at
      most (0: none); past it, its text so far with finish_reason "length"
      (or 429 if it never started).
    body_timeout_s: the seconds a client has to send a request's body once its
      headers are in (408 past it); until then the request holds no place
      among `max_requests`.
  """

  max_body_bytes: int = 1 << 20
  max_json_depth: int = 64
  max_requests: int = 256
  max_stop_chars: int = 256
  max_regex_chars: int = 4096
  max_regex_repeat: int = 1024
  max_schema_bytes: int = 16 << 10
  max_schema_depth: int = 32
  max_choices: int = 256
  max_choice_chars: int = 16 << 10
  max_tools: int = 64
  compile_workers: int = 2
  compile_queue: int = 8
  compile_per_client: int = 1
  compile_timeout_s: float = 30.0
  compile_memory_mb: int = 4096
  compile_cache_mb: int = 256
  request_timeout_s: float = 0.0
  body_timeout_s: float = 10.0

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if field.type == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
          raise ValueError(f"{field.name} must be a number >= 0, got {value!r}.")
      elif field.name == "compile_per_client":  # a share of what the pool holds
        check_int(field.name, value, 1, self.compile_workers + self.compile_queue)
      else:
        low = 0 if field.name in ("compile_queue", "compile_memory_mb", "compile_cache_mb") else 1
        check_int(field.name, value, low)
    if self.compile_timeout_s <= 0:
      raise ValueError(f"compile_timeout_s must be > 0, got {self.compile_timeout_s!r}.")
    if self.body_timeout_s <= 0:
      raise ValueError(f"body_timeout_s must be > 0, got {self.body_timeout_s!r}.")


FIELDS = tuple(f.name for f in dataclasses.fields(ServerLimits))


def from_config(config) -> ServerLimits:
  """The `ServerLimits` of a launcher's config (its fields of the same names;
  missing ones keep their defaults); ValueError naming `config.<field>`."""
  given = {name: config[name] for name in FIELDS if name in config}
  try:
    return ServerLimits(**given)
  except ValueError as e:
    raise ValueError(f"config.{e}") from None
