"""The constraint compile worker's entry: `python -I specjax/grammar/__main__.py
MEMORY_BYTES` (`specjax.serving.compile_worker` starts it; what it answers:
`specjax.grammar.worker_main`).

Run by path in isolated mode, the worker has no `specjax` to import, and the
package's `__init__` would import JAX. So this file stands a bare package in
for it: a module named `specjax` whose modules are found in its folder, its
`__init__` never run. The worker's modules then import one another as they do
in the server (`from specjax import regex_states`), and only they are loaded;
each imports only the standard library, numpy and outlines-core.
"""

import os
import sys
import types

if __name__ == "__main__":
  if "specjax" not in sys.modules:  # by path; under `python -m`, the real package
    bare = types.ModuleType("specjax", "specjax's folder, without its __init__ (JAX)")
    bare.__path__ = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    sys.modules["specjax"] = bare
  from specjax.grammar import worker_main

  worker_main(sys.argv[1:])
