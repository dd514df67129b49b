"""A choice's text as tokens arrive: detokenised in whole characters
(`Decoder`), cut before the first stop string found in linear time
(`StopMatcher`), released as deltas that hold back only what may still begin a
stop string (`ChoiceText`)."""

from __future__ import annotations

import time

from specjax.serving.request import Event


class Decoder:
  """Text of a growing token list, released as deltas: decodes the whole list
  each time and holds back a trailing U+FFFD (a character whose bytes are not
  all generated yet), so multi-token characters come out whole."""

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    self.ids: list[int] = []
    self.sent = ""

  def add(self, tokens, final: bool) -> str:
    self.ids.extend(tokens)
    text = self.tokenizer.decode(self.ids)
    if not final:
      text = text.rstrip("\ufffd")
    if not text.startswith(self.sent):  # a tokenizer whose decode is not prefix-stable
      return ""
    delta, self.sent = text[len(self.sent) :], text
    return delta


class StopMatcher:
  """Where stop strings occur in a growing text, in time linear in the text:
  one Knuth-Morris-Pratt automaton per stop string, fed each new character once.
  `held()` is the longest tail of the text that still begins a stop string
  (what a stream must hold back); no work is proportional to the stop strings'
  lengths squared, which a long stop string would make block the event loop."""

  def __init__(self, stop: list[str]):
    self.stop = stop
    self.fail = [self._failure(s) for s in stop]
    self.state = [0] * len(stop)  # per stop string: its prefix the text ends with
    self.length = 0  # characters fed

  @staticmethod
  def _failure(s: str) -> list[int]:
    fail, k = [0] * len(s), 0
    for i in range(1, len(s)):
      while k and s[i] != s[k]:
        k = fail[k - 1]
      if s[i] == s[k]:
        k += 1
      fail[i] = k
    return fail

  def feed(self, text: str) -> int | None:
    """Feeds `text`; returns the start of the earliest stop string completed
    within it (in the whole text's positions), or None."""
    found = None
    for j, (s, fail) in enumerate(zip(self.stop, self.fail)):
      k, n = self.state[j], len(s)
      for i, c in enumerate(text):
        while k and c != s[k]:
          k = fail[k - 1]
        if c == s[k]:
          k += 1
        if k == n:
          start = self.length + i + 1 - n
          found = start if found is None else min(found, start)
          k = fail[k - 1]
          break  # later matches of this string start later
      self.state[j] = k
    self.length += len(text)
    return found

  def held(self) -> int:
    return max(self.state, default=0)


class ChoiceText:
  """One choice's text as it is released: decoded token by token, cut before
  the first stop string (which is not returned), holding back only a tail that
  could still begin one. `tokens` counts up to the one that completed a stop
  string (what usage reports)."""

  def __init__(self, tokenizer, stop: list[str]):
    self.decoder, self.stop = Decoder(tokenizer), stop
    self.matcher = StopMatcher(stop)
    self.text, self.sent = "", 0
    self.tokens = 0
    self.finish_reason: str | None = None
    self.first_token_time: float | None = None

  def add(self, event: Event) -> tuple[str, list]:
    """`(text released, [(token, logprob entry or None)] of the tokens counted)`."""
    counted, tokens = [], event.tokens
    lps = event.logprobs or (None,) * len(tokens)
    size = 1 if self.stop else max(len(tokens), 1)  # token by token only to find a stop
    for i in range(0, len(tokens), size):
      new = self.decoder.add(tokens[i : i + size], event.finished and i + size >= len(tokens))
      self.text += new
      self.tokens += len(tokens[i : i + size])
      counted += zip(tokens[i : i + size], lps[i : i + size])
      cut = self.matcher.feed(new) if self.stop else None
      if cut is not None:
        self.text, self.finish_reason = self.text[:cut], "stop"
        break
    if event.finished and self.finish_reason is None:
      self.text += self.decoder.add([], True)
      self.finish_reason = event.finish_reason
    if counted and self.first_token_time is None:
      self.first_token_time = time.perf_counter()
    end = len(self.text)
    if self.finish_reason is None:  # hold back a tail that may begin a stop string
      end -= self.matcher.held()
    delta, self.sent = self.text[self.sent : max(end, self.sent)], max(end, self.sent)
    return delta, counted
