"""Chat templates render as transformers renders them (`specjax.data.chat`)."""

import json

import pytest

from specjax import pretrained
from specjax.data.chat import BUNDLED_TEMPLATE, ChatTemplate, check_messages

# Llama-3's template (abridged: no tools), with its special tokens and a
# {% generation %} block as transformers' assistant masks use.
LLAMA3 = (
  "{{ bos_token }}{% for message in messages %}"
  "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
  "{% if message['role'] == 'assistant' %}{% generation %}"
  "{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
  "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
  "{% if add_generation_prompt %}"
  "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
CHAT = [
  {"role": "system", "content": "Be brief. ünïcode"},
  {"role": "user", "content": "Hi"},
  {"role": "assistant", "content": "Hello!"},
  {"role": "user", "content": "And?"},
  {"role": "assistant", "content": "Done."},
]


def _checkpoint(tmp_path, config):
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  return str(tmp_path)


def test_renders_as_transformers(tmp_path):
  transformers = pytest.importorskip("transformers")
  tokenizers = pytest.importorskip("tokenizers")
  bos = {"content": "<|begin_of_text|>", "special": True, "__type": "AddedToken"}
  path = _checkpoint(tmp_path, {"chat_template": LLAMA3, "bos_token": bos, "eos_token": "<e>"})
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
  fast = transformers.PreTrainedTokenizerFast(
    tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<e>", chat_template=LLAMA3
  )
  template = ChatTemplate.from_checkpoint(path)
  for gen in (False, True):
    for turns in (CHAT, CHAT[:4]):
      expected = fast.apply_chat_template(turns, tokenize=False, add_generation_prompt=gen)
      assert template.render(turns, add_generation_prompt=gen) == expected


def test_assistant_spans(tmp_path):
  template = ChatTemplate.from_checkpoint(_checkpoint(tmp_path, {"chat_template": LLAMA3}))
  text = template.render(CHAT)
  spans = template.assistant_spans(CHAT)
  assert [text[a:b] for a, b in spans] == ["Hello!<|eot_id|>", "Done.<|eot_id|>"]


def test_template_sources(tmp_path):
  (tmp_path / "a").mkdir()
  named = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": "{{ 'd' }}"}]
  assert ChatTemplate.from_checkpoint(_checkpoint(tmp_path / "a", {"chat_template": named}))
  (tmp_path / "b").mkdir()
  (tmp_path / "b" / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
  assert ChatTemplate.from_checkpoint(str(tmp_path / "b")).render(CHAT) == "Be brief. ünïcode"
  (tmp_path / "c").mkdir()
  assert ChatTemplate.from_checkpoint(_checkpoint(tmp_path / "c", {"eos_token": "</s>"})) is None
  bundled = ChatTemplate.from_checkpoint(pretrained.TARGET_DIR)
  assert bundled.source == BUNDLED_TEMPLATE
  assert bundled.render(CHAT[1:2], add_generation_prompt=True) == "# user:\nHi\n# assistant:\n"


@pytest.mark.parametrize(
  "messages, match",
  [
    ([], "non-empty list"),
    ([{"role": "bot", "content": "x"}], r"messages\[0\].role"),
    ([{"role": "user", "content": "x"}, {"role": "user"}], r"messages\[1\].content"),
    (["hi"], r"messages\[0\] must be an object"),
  ],
)
def test_bad_messages(messages, match):
  with pytest.raises(ValueError, match=match):
    check_messages(messages)


def test_template_errors():
  with pytest.raises(ValueError, match="syntax error at line 1"):
    ChatTemplate("{% if x %}")
  raising = ChatTemplate("{{ raise_exception('only user turns') }}")
  with pytest.raises(Exception, match="only user turns"):
    raising.render(CHAT)
  rewriting = ChatTemplate(
    "{{ messages | length }}{% for m in messages %}{{ m.content }}{% endfor %}"
  )
  with pytest.raises(ValueError, match="turn by turn"):
    rewriting.assistant_spans(CHAT)
