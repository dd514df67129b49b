"""The test tiers of tests/conftest.py: which cases the default run keeps."""

import types

import conftest
import pytest


def item(*marks, case=None):
  """A stand-in for a collected test: its markers and, if parametrized, its case id."""
  by_name = {m.mark.name: m.mark for m in marks}
  stub = types.SimpleNamespace(get_closest_marker=by_name.get, nodeid="t.py::f", function=item)
  if case is not None:
    stub.callspec = types.SimpleNamespace(id=case)
  return stub


def test_slow_tests_and_unsampled_cases_leave_the_default_tier():
  assert conftest._in_default_tier(item(), 0)
  assert not conftest._in_default_tier(item(pytest.mark.slow), 0)
  first = pytest.mark.sample(1)
  assert conftest._in_default_tier(item(first, case="a"), 0)
  assert not conftest._in_default_tier(item(first, case="b"), 1)
  named = pytest.mark.sample("b", "c")
  assert [conftest._in_default_tier(item(named, case=c), i) for i, c in enumerate("abcd")] == [
    False,
    True,
    True,
    False,
  ]


def test_a_sample_naming_no_case_fails_collection():
  items = [item(pytest.mark.sample("llama", "gemma"), case=c) for c in ("llama", "gpt2")]
  with pytest.raises(pytest.UsageError, match=r"sample names no case \['gemma'\]"):
    conftest._SampleIdsCheck().pytest_collection_modifyitems(items)
  fine = [item(pytest.mark.sample("llama"), case=c) for c in ("llama", "gpt2")]
  conftest._SampleIdsCheck().pytest_collection_modifyitems(fine)  # raises nothing
