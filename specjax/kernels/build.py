"""Building and loading `cpu_matmul.cc`: compiled on first use for one variant,
cached, loaded and registered as XLA FFI targets, or a `KernelUnavailable`
naming why not.

Compiling code at run time is done carefully: the cache directory is created
0700 and must be the user's own and not writable by others; a lock serialises
builds across processes; the bytes compiled are the bytes hashed into the
library's name (source, flags, JAX version, the compiler's path and
`--version`, the CPU); a library is written to a temporary name and renamed
into place with its sha256 beside it, checked before every load (dlopen of a
truncated library kills the process instead of raising). Any failure (no
compiler, a compile error, missing FFI headers, an unwritable or foreign cache,
a corrupt library, a missing symbol) becomes a `KernelUnavailable` naming the
cause, never an exception of another type.
"""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import hashlib
import os
import shutil
import stat
import subprocess
import tempfile

import jax

from specjax.kernels import cpu

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_matmul.cc")
# The FFI targets the library registers: w stored [K, N], and [N, K] (a tied head).
TARGET = "specjax_cpu_matmul"
TARGET_T = "specjax_cpu_matmul_t"
_COMMON_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-w", "-ffp-contract=off")
_COMPILE_TIMEOUT_S = 600


class KernelUnavailable(Exception):
  """The kernel cannot be built, loaded or registered here; the message says why."""


@dataclasses.dataclass(frozen=True)
class Library:
  """A loaded, registered kernel library."""

  variant: str
  key: str
  path: str
  handle: ctypes.CDLL = dataclasses.field(repr=False, compare=False)

  def target(self, transposed: bool) -> str:
    """The FFI target of one layout: one name per build, as a process may load
    several (the tests load each variant)."""
    return f"{TARGET_T if transposed else TARGET}_{self.variant}_{self.key}"


def cache_dir() -> str:
  """Where libraries are cached: `$SPECJAX_KERNEL_CACHE`, else ~/.cache/specjax/kernels."""
  return os.environ.get("SPECJAX_KERNEL_CACHE") or os.path.join(
    os.path.expanduser("~"), ".cache", "specjax", "kernels"
  )


def secure_dir(path: str) -> str:
  """Creates `path` (0700) if missing and checks it is a directory owned by this
  user, writable, and not writable by group or others; returns it."""
  try:
    os.makedirs(path, mode=0o700, exist_ok=True)
    info = os.lstat(path)
  except OSError as e:
    raise KernelUnavailable(f"cannot create the kernel cache {path!r}: {e}") from None
  if not stat.S_ISDIR(info.st_mode):
    raise KernelUnavailable(f"the kernel cache {path!r} is not a directory (or is a symlink)")
  if hasattr(os, "getuid") and info.st_uid != os.getuid():
    raise KernelUnavailable(
      f"the kernel cache {path!r} is owned by uid {info.st_uid}, not by this user "
      f"({os.getuid()}); set SPECJAX_KERNEL_CACHE to a directory of your own"
    )
  if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
    raise KernelUnavailable(
      f"the kernel cache {path!r} is writable by group or others "
      f"(mode {stat.S_IMODE(info.st_mode):o}); chmod 700 it"
    )
  if not os.access(path, os.W_OK | os.X_OK):
    raise KernelUnavailable(f"the kernel cache {path!r} is not writable")
  return path


def compiler() -> str:
  """The C++ compiler: `$CXX`, else g++, else clang++ (its full path)."""
  name = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
  if not name:
    raise KernelUnavailable("no C++ compiler (g++ or clang++ on PATH; or set CXX)")
  path = shutil.which(name)
  if not path:
    raise KernelUnavailable(f"the C++ compiler CXX={name!r} was not found")
  return path


def _run(command: list[str], what: str) -> str:
  try:
    done = subprocess.run(
      command, capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S, check=False
    )
  except (OSError, subprocess.SubprocessError) as e:
    raise KernelUnavailable(f"{what} failed to run: {e}") from None
  if done.returncode != 0:
    detail = (done.stderr or done.stdout or "").strip()[-2000:]
    raise KernelUnavailable(f"{what} failed (exit {done.returncode}): {detail or 'no output'}")
  return done.stdout


def flags(variant: str) -> list[str]:
  """The compiler flags of `variant`'s build."""
  if variant not in cpu.VARIANTS:
    raise ValueError(f"variant must be one of {sorted(cpu.VARIANTS)}, got {variant!r}.")
  arch = list(cpu.VARIANTS[variant][0])
  if arch:  # x86 levels: tuned for this CPU, which the cache key names
    arch.append("-mtune=native")
  return [*_COMMON_FLAGS, *arch, f"-I{jax.ffi.include_dir()}"]


def _check_own_file(path: str) -> None:
  info = os.lstat(path)
  if not stat.S_ISREG(info.st_mode):
    raise KernelUnavailable(f"the cached kernel {path!r} is not a regular file")
  if hasattr(os, "getuid") and info.st_uid != os.getuid():
    raise KernelUnavailable(f"the cached kernel {path!r} is not owned by this user")
  if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
    raise KernelUnavailable(f"the cached kernel {path!r} is writable by group or others")


@dataclasses.dataclass(frozen=True)
class _Recipe:
  """What goes into one library: the bytes compiled, by which compiler, how."""

  variant: str
  source: bytes
  cxx: str
  flags: list[str]
  key: str  # hash of all of the above, the JAX version and the CPU

  @property
  def path(self) -> str:
    return os.path.join(cache_dir(), f"cpu_matmul-{self.variant}-{self.key}.so")


def recipe(variant: str) -> _Recipe:
  """The source, compiler (with its `--version`) and flags of `variant`'s library."""
  try:
    with open(SOURCE, "rb") as f:
      source = f.read()
  except OSError as e:
    raise KernelUnavailable(f"the kernel source is missing: {e}") from None
  cxx = compiler()
  version = _run([cxx, "--version"], f"{cxx} --version")
  command_flags = flags(variant)
  parts = (source, jax.__version__, cxx, version, " ".join(command_flags), cpu.model())
  key = hashlib.sha256(
    b"\0".join(p.encode() if isinstance(p, str) else p for p in parts)
  ).hexdigest()[:16]
  return _Recipe(variant, source, cxx, command_flags, key)


# Libraries registered in this process, by key: XLA keeps an FFI target for the
# process's life, so a second build of the same code reuses the first's targets.
_registered: dict[str, Library] = {}


def build(variant: str) -> Library:
  """Builds `variant` (or finds it in the cache), loads and registers it.

  Raises:
    KernelUnavailable: naming the cause, for any failure.
  """
  made = recipe(variant)
  directory = secure_dir(cache_dir())
  path = made.path
  try:
    with open(os.path.join(directory, ".lock"), "a") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same library
      if not os.path.exists(path):
        _compile(made.cxx, made.flags, made.source, path)
      _check_own_file(path)
      _check_digest(path)
      handle = ctypes.CDLL(path)
  except OSError as e:
    raise KernelUnavailable(
      f"the cached kernel {path!r} cannot be loaded ({e}); delete it to rebuild"
    ) from None
  try:
    handle.SpecjaxKernelIsa.restype = ctypes.c_char_p
    built = handle.SpecjaxKernelIsa().decode()
    symbols = {False: handle.SpecjaxMatmul, True: handle.SpecjaxMatmulT}
  except AttributeError as e:
    raise KernelUnavailable(f"the kernel {path!r} lacks a symbol: {e}") from None
  if built != variant:
    raise KernelUnavailable(f"the kernel {path!r} was built as {built!r}, not {variant!r}")
  if made.key in _registered:
    return dataclasses.replace(_registered[made.key], path=path)
  library = Library(variant, made.key, path, handle)
  try:
    for transposed, symbol in symbols.items():
      target = library.target(transposed)
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(symbol), platform="cpu")
  except Exception as e:  # jaxlib's registration errors have no common type
    raise KernelUnavailable(f"registering the kernel with XLA failed: {e}") from None
  _registered[made.key] = library
  return library


def _digest(path: str) -> str:
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


def _check_digest(path: str) -> None:
  """Refuses a library whose bytes are not those the build wrote: loading a
  truncated shared library can kill the process (SIGBUS), not raise."""
  try:
    with open(path + ".sha256") as f:
      expected = f.read().strip()
  except OSError:
    expected = None
  if expected != _digest(path):
    raise KernelUnavailable(
      f"the cached kernel {path!r} is corrupt (its sha256 is not the build's); delete it to rebuild"
    )


def _compile(cxx: str, command_flags: list[str], source: bytes, path: str) -> None:
  """Compiles `source` (the bytes hashed into `path`) to `path` via a temporary name."""
  directory = os.path.dirname(path)
  with tempfile.TemporaryDirectory(dir=directory) as scratch:
    src = os.path.join(scratch, "cpu_matmul.cc")
    out = os.path.join(scratch, "cpu_matmul.so")
    with open(src, "wb") as f:
      f.write(source)
    _run([cxx, *command_flags, src, "-o", out], f"compiling the kernel ({os.path.basename(cxx)})")
    os.chmod(out, 0o700)
    # The digest first: a library in place always has its digest beside it.
    with open(path + ".sha256", "w") as f:
      f.write(_digest(out))
    os.replace(out, path)
