"""Runs the front door's tests in their own process, next to the rest of the suite.

The front door: every launcher with its defaults (tests/test_launchers.py,
`test_launcher_runs`) and every code block of README.md and docs/*.md
(tests/test_docs.py, `test_blocks_run`). Both start `python -m experiments...`
subprocesses one after another; each compiles on one core. The child also takes
the other tests marked `front_door` in `FILES` (the decode launcher end to end,
the launchers' user errors, the two-process run, the benchmark launcher's
in-process run, and library files moved there to balance the processes). So when this test is
collected with the rest of the suite, tests/conftest.py starts those tests in a
child pytest process right away (`start_in_background`) and deselects them in
this one: they run on the core the main process leaves idle while it compiles,
and this test, which conftest runs last, collects their result. Selected alone (`pytest
tests/test_docs.py`, `-k`), they run in this process as any test does.
The child inherits the tier (tests/conftest.py): by default it runs every
launcher at a small size and the quick files' blocks; with SPECJAX_SLOW_TESTS=1
also the launchers' full-size runs and every guide.
"""

import subprocess

from helpers import pytest_process, suite_output

# Every launcher step and docs block has its own limit (at most 900 s); this
# bounds the whole run, so that CI cannot hang here.
TIMEOUT_S = 3600
# The tests the child runs: the front-door marker's, in these files. Besides the
# launchers and the docs blocks, the end-to-end tests of the decode launcher, the
# launchers' user errors and the two-process run: they run launcher code or wait
# on subprocesses, and the main process, the longer of the two, sheds them
# (2-core AMD EPYC, 2026-12-02: main 1,427 s, this child 1,052 s before). So
# does the benchmark launcher's in-process run (26 s of the main process's 632 s
# against this child's 538 s, 2026-12-02 on a faster 2-core AMD EPYC).
FILES = ("tests/test_launchers.py", "tests/test_docs.py")
FILES += ("tests/test_decode.py", "tests/test_launcher_errors.py", "tests/test_multiprocess.py")
FILES += ("tests/test_benchmark.py",)
# And, to balance the two processes (each compiles on one core), whole library
# files: tests/conftest.py marks every test of these `front_door`. From an empty
# cache on a 2-core Xeon, 2026-12-06, the main process took 1,110-1,208 s and
# this child alone 523 s; the first four took 232 s of the main's. With them here
# the whole suite took 1,014-1,022 s and the main process was still the longer
# one (a fresh run with -rA on a loaded machine: child 778 s, main 1,364 s), so
# three more followed (test_inplace.py, about 50 s, went back when the main
# process then waited 154 s for the child).
BALANCE = ("tests/test_coupled.py", "tests/test_constrained_drafts.py")
BALANCE += ("tests/test_constraints.py", "tests/test_constraint_layouts.py")
BALANCE += ("tests/test_generation.py", "tests/test_eagle3.py", "tests/test_scan.py")
FILES += BALANCE


def start_front_door() -> subprocess.Popen:
  return pytest_process(["-m", "front_door", "--durations=0", *FILES])


def test_every_launcher_and_documented_command_runs(background):
  suite = background(start_front_door)
  output = suite_output(suite, TIMEOUT_S)
  print(output[-6000:])  # each step's and block's time, shown with -rA or on failure
  assert suite.returncode == 0, output[-12000:]


test_every_launcher_and_documented_command_runs.start_in_background = start_front_door
