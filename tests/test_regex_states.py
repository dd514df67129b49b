"""A regex's automaton, measured before it is compiled (issue 73, requirement 4):
`specjax.regex_states` counts the states outlines-core's table will have and
stops at a cap, `specjax.grammar.regex_repeat` reads verbose mode, and the
compile worker's `check_size` refuses both hostile examples of the issue at
once, where each ran until the compile timeout. No JAX: the tables come from
`grammar.compile_arrays` over a byte vocabulary.
"""

import time

import outlines_core
import pytest

from specjax import grammar, regex_states

EOS = 0
PIECES = [None] + [bytes([i]) for i in range(1, 256)]  # a byte tokenizer's, EOS special
HOSTILE = ["(?x)(?:a{1000}) {1000}", "(a|b)*a(a|b){20}"]  # the issue's: 10^6 and 2^21 states


@pytest.fixture(scope="module")
def vocabulary():
  return outlines_core.Vocabulary(EOS, grammar.vocabulary_pieces(PIECES, [EOS], 256))


def _table_states(pattern: str, vocabulary) -> int:
  return len(grammar.compile_arrays(pattern, vocabulary, [EOS], 256)[0])


# fmt: off
ASCII = [
  "[0-9]{3}", "a{1000}b{1000}c{100}", "(a|b)*a(a|b){8}", "(?i)hello", "[a-z ]{0,64}", "(ab|cd)*e",
  "(?x) a b c # a comment\n d", "(?x:a ) {4}", "(?x)(?-x:(?:a{10}) {100})", "a(?x)(?:b{3}) {3}",
  "(?x)a{ 3 , 5 }", "(?ix)(?:A{4})  {4}", "x{1}|y{9}", "(?P<x>a)+", "(?<y>b){2}",
  "[a-z&&[^aeiou]]{3}", "[[:alpha:]]{2}", "[a-c--b]{3}", "a*b+c?",
  "[0-9]+(\\.[0-9]+)?", "(foo|foobar|fob){2}", "([a-z]+ *){0,20}", "\\{\\x41\\u0042\\x{43}\\}",
  "a\\.b", "a{2}{3}", "[]a]{2}", "[a-c]{2}", "(a*){0,1000}", "(a+)+b", "(x*y*)*z",
]
# fmt: on


# Over bytes, as the table: characters of several bytes count as many states.
UTF8 = ["é{10}", "[^\\x00-\\x7f]{3}", "\\s*", "[αβγ]{2}δ", "(?i)éa", "[\\u0100-\\u{10FFFF}]"]


@pytest.mark.parametrize("pattern", ASCII + UTF8)
def test_the_count_is_the_tables(pattern, vocabulary):
  assert regex_states.count_states(pattern, 10**5) == _table_states(pattern, vocabulary)


# fmt: off
WIDER = [
  "\\d{1,3}(\\.\\d{1,3}){3}", "\\w+@\\w+", "(.{0,4}){0,3}x", "(?s).{2}", "\\p{Greek}{5}",
  "(\\d*,?){0,50}", "((ab)*c?){0,200}", "(a*b*){0,500}", "([^a]*){0,1000}",
]
# fmt: on


@pytest.mark.parametrize("pattern", WIDER)
def test_elsewhere_it_counts_close_to_the_table(pattern, vocabulary):
  """Unicode's classes (this Python's tables; a script as one block of its
  size) and the two constructions differ a little. A repetition of what may
  match "" is not counted once per bound left: `(a*){0,1000}` has 2 states."""
  counted, table = regex_states.count_states(pattern, 10**5), _table_states(pattern, vocabulary)
  assert table / 8 <= counted <= 1.1 * table, (counted, table)


def test_a_schemas_regex_is_counted(vocabulary):
  schema = '{"type": "array", "items": {"type": "boolean"}, "maxItems": 5}'
  regex = grammar.to_regex(grammar.JsonSchema(schema))
  counted = regex_states.count_states(regex, 10**5)
  assert counted is not None and counted <= _table_states(regex, vocabulary)


# \\w{300}: 300 copies (under max_regex_repeat) but 94,922 states in the table.
@pytest.mark.parametrize("pattern", [*HOSTILE, "(?:a{1000}){1000}", "a{300000}", "\\w{300}"])
def test_a_count_stops_just_past_its_cap(pattern):
  start = time.perf_counter()
  assert regex_states.count_states(pattern, 8190) == 8191
  assert time.perf_counter() - start < 10  # about 0.1 s; outlines-core: minutes or hours


@pytest.mark.parametrize("pattern", ["(", "a)", "(?=a)b", "a{2,1}", "\\q", "[a", "*a", "a{"])
def test_what_it_does_not_parse_it_does_not_count(pattern):
  assert regex_states.count_states(pattern, 100) is None


def test_a_count_too_costly_gives_up():
  # ([a-z]{0,40}){0,25}x has 2,002 states, each a set of up to a thousand derivatives.
  assert regex_states.count_states("([a-z]{0,40}){0,25}x", 10**5, budget=10_000) is None
  assert regex_states.count_states("([a-z]{0,4}){0,3}x", 10**5, budget=10_000) == 26
  assert regex_states.count_states("([a-z]{0,40}){0,25}x", 10**5, seconds=0.0) is None


@pytest.mark.parametrize(
  "pattern, copies",
  [
    ("(?x)(?:a{1000}) {1000}", 10**6), ("(?x)(?:a{10}) # c {5}\n {100}", 1000),
    ("(?x)(?:a{10})\\ {100}", 100), ("(?x)(?-x:(?:a{10}) {100})", 100),
    ("(?x: (?:a{10}) ) {100}", 100), ("(?x:(?:a{10}) {100})", 1000), ("a(?x)(?:b{3}) {3}", 9),
    ("(?x)a{ 3 , 5 }", 5), ("(?ix)(?:a{4})  {4}", 16), ("a{2}{3}", 6), ("(?x)[\\ ]{7}", 7),
  ],
)  # fmt: skip
def test_regex_repeat_reads_verbose_mode(pattern, copies, vocabulary):
  """In verbose mode whitespace and comments are no pieces, so a count after
  them repeats what precedes them; the table agrees (its states grow with it)."""
  assert grammar.regex_repeat(pattern) == copies
  if copies <= 1000:
    assert regex_states.count_states(pattern, 10**5) == _table_states(pattern, vocabulary)


def test_the_worker_refuses_the_hostile_examples_at_once(vocabulary):
  answers = {}
  for pattern in HOSTILE:
    start = time.perf_counter()
    answer = grammar.compile_message(vocabulary, [EOS], 256, ("regex", pattern, 4095, 1024))
    answers[pattern] = answer, time.perf_counter() - start
  (kind, why), seconds = answers[HOSTILE[0]]
  assert kind == "error" and "1000000 copies" in why and "max_regex_repeat" in why, why
  (kind, why), seconds = answers[HOSTILE[1]]
  assert kind == "error" and "more than 8190 states" in why and "constraint_states" in why, why
  assert max(s for _, s in answers.values()) < 10  # before: the compile timeout (90 s)
  # The pattern is counted as it is compiled, inside a group it may close early.
  early = ")(a|b)*a(a|b){20}(?:"
  answer = grammar.compile_message(vocabulary, [EOS], 256, ("regex", early, 4095, 1024))
  assert answer[0] == "error" and "more than 8190 states" in answer[1]
  # A Unicode class repeated within max_regex_repeat: its bytes count.
  answer = grammar.compile_message(vocabulary, [EOS], 256, ("regex", "\\w{1000}", 4095, 1024))
  assert answer[0] == "error" and "more than 8190 states" in answer[1]
  # Without a repetition bound, the state count stops the first one too.
  answer = grammar.compile_message(vocabulary, [EOS], 256, ("regex", HOSTILE[0], 4095, 0))
  assert answer[0] == "error" and "more than 8190 states" in answer[1]
  # A schema whose regex repeats too much is told so in a schema's words.
  schema = '{"type": "string", "maxLength": 5000}'
  answer = grammar.compile_message(vocabulary, [EOS], 256, ("json_schema", schema, 4095, 1024))
  assert answer[0] == "error" and "maxLength, maxItems" in answer[1]


def test_what_fits_twice_the_table_is_compiled_and_counted_exactly(vocabulary):
  """Past the table but within the margin: compiled, then refused by the
  table's own count (the number the client reads)."""
  answer = grammar.compile_message(
    vocabulary, [EOS], 256, ("regex", "a{1000}b{1000}c{100}", 2047, 1024)
  )
  assert answer[0] == "error" and "2101 states" in answer[1]
  answer = grammar.compile_message(vocabulary, [EOS], 256, ("regex", "[0-9]{3}", 2047, 1024))
  assert answer[0] == "ok"
