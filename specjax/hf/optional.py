"""torch and transformers: optional packages, imported only where they are needed.

  torch, transformers = import_torch_transformers("make_hf_checkpoint")

Only writing random Hugging Face checkpoints (`experiments/make_hf_checkpoint.py`)
and timing transformers' `generate` (`decode --config.compare_transformers`)
need them. When either is missing the error is one line saying which and how
to install them, not an ImportError traceback.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

# .ci/run's pin: a CPU build where a local wheel exists. On the public index a
# bare `torch` is a multi-GB CUDA build; PyTorch's own index has the CPU one.
TORCH_PIN = "torch==2.13.0"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


class MissingPackagesError(ImportError, ValueError):
  """Optional packages are not installed (a user error: launchers print it as one line)."""


def install_hint(missing: tuple[str, ...]) -> str:
  """How to install the `missing` packages (of "torch", "transformers")."""
  if "torch" not in missing:
    return "pip install " + " ".join(missing)
  return (
    f"pip install {TORCH_PIN} transformers (where no local CPU wheel of {TORCH_PIN} exists, "
    f"PyTorch's CPU build: pip install torch --index-url {TORCH_CPU_INDEX}, then pip "
    "install transformers)"
  )


def import_torch_transformers(purpose: str) -> tuple[ModuleType, ModuleType]:
  """`(torch, transformers)`, or a `MissingPackagesError` naming what `purpose` lacks.

  Args:
    purpose: what needs them, for the message (e.g. "--config.compare_transformers").
  """
  # Looked up before anything is imported: transformers without torch imports,
  # but warns on stderr, and the error should be the one line there.
  missing = [name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None]
  if missing:
    raise MissingPackagesError(
      f"{purpose} needs {' and '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
      f"not installed: {install_hint(tuple(missing))}",
      name=missing[0],
    )
  return importlib.import_module("torch"), importlib.import_module("transformers")
