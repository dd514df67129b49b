"""outlines-core, imported when first needed (the extra `specjax[structured]`),
and which of the errors it raises must propagate (`_uncaught`).
"""

from __future__ import annotations


def _outlines():
  try:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema
  except ImportError as e:  # pragma: no cover - the test extra installs it
    raise ImportError("constraints need outlines-core: pip install 'specjax[structured]'") from e
  return outlines_core, build_regex_from_schema


def _uncaught(error: BaseException) -> bool:
  """Whether `error` must propagate: outlines-core's PanicException derives from
  BaseException, so a bare `except Exception` misses it; only these are real exits."""
  return isinstance(error, (KeyboardInterrupt, SystemExit, GeneratorExit))
