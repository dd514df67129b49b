"""Tool calls without a server (`specjax.serving.tools`, `specjax.grammar.ToolCalls`).

* The constraint's automaton spells exactly what each `tool_choice` allows
  ("required" and a named function force calls whose arguments validate,
  "auto" allows text, or text and then calls, never a malformed call;
  `parallel_tool_calls` false allows one call).
* The parser splits a text into content and OpenAI's `tool_calls`, and any
  chunking of the text gives the same content, calls and joined arguments.
* Requests' `tools` / `tool_choice` are checked, each error naming its field;
  assistant turns' JSON-string arguments reach the template as objects.
* A Hermes-style template with tools renders as transformers renders it.
"""

import json

import jsonschema
import pytest

from specjax import constraints as C
from specjax.data.chat import ChatTemplate, check_messages
from specjax.serving.tools import (
  HERMES,
  ToolCallParser,
  ToolFormat,
  ToolOffer,
  template_messages,
)

EOS = 0
PIECES = [None] + [bytes([i]) for i in range(1, 256)]  # bytes; id 0 EOS
WEATHER = {
  "type": "object",
  "properties": {"city": {"type": "string", "maxLength": 8}},
  "required": ["city"],
}
ADD = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
TOOLS = [
  {"type": "function", "function": {"name": "weather", "description": "d", "parameters": WEATHER}},
  {"type": "function", "function": {"name": "add", "parameters": ADD}},
]


def call(name, args):
  return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


ONE, TWO = call("weather", {"city": "Paris"}), call("add", {"n": 12})


def accepts(automaton, text: str) -> bool:
  s = automaton.start
  for b in text.encode():
    s = automaton.next_state[s, b]
    if s < 0:
      return False
  return bool(automaton.accepting[s])


def automaton(choice, parallel=True):
  offer = ToolOffer.of(TOOLS, choice, parallel, max_tools=8)
  return C.compile_constraint(offer.constraint(HERMES), PIECES, [EOS], 256)


def test_the_automaton_spells_what_each_tool_choice_allows():
  required, auto = automaton("required"), automaton("auto")
  named, single = automaton({"type": "function", "function": {"name": "add"}}), automaton(None, 0)
  cases = {
    ONE: (True, True, False, True),
    ONE + "\n" + TWO: (True, True, False, False),
    "Sure.": (False, True, False, True),
    "Let me see. " + TWO: (False, True, False, True),
    TWO: (True, True, True, True),
    "a <tool_call>\nnot json\n</tool_call>": (False, False, False, False),
    call("weather", {"city": "far too long"}): (False, False, False, False),
    call("weather", {"town": "x"}): (False, False, False, False),
    call("nope", {}): (False, False, False, False),
  }
  for text, expected in cases.items():
    got = tuple(accepts(a, text) for a in (required, auto, named, single))
    assert got == expected, text


@pytest.mark.parametrize("step", [1, 3, 10, 1000])
def test_the_parser_splits_content_and_calls_alike_in_any_chunks(step):
  text = "Checking } <tool_c" + ONE.replace("Paris", 'Pa}ri\\"s') + "\n" + TWO
  parser, content, deltas = ToolCallParser(HERMES), "", []
  for i in range(0, len(text), step):
    c, d = parser.feed(text[i : i + step], final=i + step >= len(text))
    content, deltas = content + c, deltas + d
  assert content == "Checking } <tool_c" and parser.finished_calls
  names = [c["function"]["name"] for c in parser.calls]
  args = [json.loads(c["function"]["arguments"]) for c in parser.calls]
  assert names == ["weather", "add"] and args == [{"city": 'Pa}ri"s'}, {"n": 12}]
  joined = ["", ""]
  for d in deltas:  # the stream's pieces: the first names the call, the rest add arguments
    joined[d["index"]] += d["function"]["arguments"]
    assert ("id" in d) == ("name" in d["function"])
  assert joined == [c["function"]["arguments"] for c in parser.calls]
  jsonschema.validate(args[0], WEATHER)
  cut = ToolCallParser(HERMES)  # a text cut inside a call: no finished calls
  cut.feed(ONE[:-3], final=True)
  assert len(cut.calls) == 1 and not cut.finished_calls


@pytest.mark.parametrize(
  "tools, choice, message",
  [
    (None, "auto", "tool_choice needs tools"),
    ([], None, "tools must be a non-empty list"),
    ([{"type": "code"}], None, r'tools\[0\].type must be "function"'),
    ([{"type": "function", "function": {"name": "a b"}}], None, r"tools\[0\].function.name"),
    ([{"type": "function", "function": {"name": "f", "x": 1}}], None, "x is not a supported"),
    ([TOOLS[0], TOOLS[0]], None, "offered twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, "JSON schema"),
    (TOOLS, "sometimes", "tool_choice must be one of none, auto, required"),
    (TOOLS, {"type": "function", "function": {"name": "x"}}, "'x' is not among the tools"),
    (TOOLS * 5, None, r"at most 8 functions \(max_tools\)"),
  ],
)
def test_bad_tools_name_their_field(tools, choice, message):
  with pytest.raises(ValueError, match=message):
    ToolOffer.of(tools, choice, True, max_tools=8)


def test_no_tools_and_none_ask_for_nothing():
  assert ToolOffer.of(None, None, True, 8) is None and ToolOffer.of(None, "none", True, 8) is None
  assert ToolOffer.of(TOOLS, "none", True, 8).constraint(HERMES) is None


# A Hermes-style template (the format Qwen2.5 and Qwen3 use), written for these tests.
HERMES_TEMPLATE = (
  "{% if tools %}<|im_start|>system\nYou may call functions:\n<tools>\n"
  "{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
  'Call one as <tool_call>\n{"name": <name>, "arguments": <object>}\n</tool_call><|im_end|>\n'
  "{% endif %}"
  "{% for m in messages %}<|im_start|>{{ m.role }}\n"
  "{% if m.content %}{{ m.content }}{% endif %}"
  "{% for c in m.tool_calls or [] %}"
  '<tool_call>\n{"name": "{{ c.function.name }}", "arguments": '
  "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TURNS = [
  {"role": "user", "content": "Weather in Paris?"},
  {
    "role": "assistant",
    "content": None,
    "tool_calls": [
      {
        "id": "call_1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
      }
    ],
  },
  {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


def test_tools_render_as_transformers_renders_them():
  from tokenizers import Tokenizer, models
  from transformers import PreTrainedTokenizerFast

  template = ChatTemplate(HERMES_TEMPLATE)
  assert ToolFormat.of(template) is HERMES and ToolFormat.of(ChatTemplate("{{ 1 }}")) is None
  messages = template_messages(check_messages(TURNS))
  assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
  fast = PreTrainedTokenizerFast(
    tokenizer_object=Tokenizer(models.WordLevel({"x": 0}, unk_token="x")),
    chat_template=HERMES_TEMPLATE,
  )
  ours = template.render(messages, add_generation_prompt=True, tools=TOOLS)
  theirs = fast.apply_chat_template(
    messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
  )
  assert ours == theirs and '"arguments": {"city": "Paris"}}' in ours
  assert template.render(messages[:1]) == fast.apply_chat_template(messages[:1], tokenize=False)
  bad = [{**TURNS[1], "tool_calls": [{"function": {"name": "f", "arguments": "{nope"}}]}]
  with pytest.raises(ValueError, match=r"messages\[0\].tool_calls\[0\].function.arguments"):
    template_messages(check_messages(bad))
  for wrong, message in [
    ([{"role": "user", "content": None}], r"messages\[0\].content must be a string"),
    ([{"role": "user", "content": "x", "tool_calls": TURNS[1]["tool_calls"]}], "only an assistant"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"x": 1}]}], r"tool_calls\[0\] must"),
  ]:
    with pytest.raises(ValueError, match=message):
      check_messages(wrong)
