"""Streams: an answer's text sent as it is sampled, never more than the final answer holds.

The engine tells the port each streamed segment's tokens after every
iteration (`EnginePort.submit(on_tokens=...)`); a `TextStream` per choice
turns them into text deltas. What it sends is always a prefix of the answer
the request ends with (`answers.finish`), so it holds back what may still
change: the text of a final stop token (dropped from the answer unless asked
for), an incomplete UTF-8 sequence, and the end of the text that could begin
a stop string; after a stop string it sends nothing more (the answer is cut
there). When the segment ends, the rest of the answer follows in one delta
with its finish reason. Choices whose text is not known until the end (tool
calls parsed from it) send theirs then.
"""

from __future__ import annotations


class TextStream:
  """One choice's text as sampled so far, released only where it is final."""

  def __init__(self, detokenize, *, stops, stop_ids, live: bool = True):
    """Args:
      detokenize: token ids -> text, as the answer is written.
      stops: the request's stop strings.
      stop_ids: the token ids a segment may end on.
      live: whether to send text before the segment ends (False: all at the end).
    """
    self._detokenize, self._stops, self._stop_ids = detokenize, [s for s in stops if s], stop_ids
    self._frozen = not live
    self._seen = 0  # tokens of the latest update (an older one may arrive late)
    self.sent = ""

  def update(self, tokens) -> str:
    """The new text the tokens so far allow sending ("" for none)."""
    if self._frozen or len(tokens) <= self._seen:
      return ""
    self._seen = len(tokens)
    if tokens and tokens[-1] in self._stop_ids:  # (its text may not be part of the answer)
      tokens = tokens[:-1]
    text = self._detokenize(tokens).rstrip("\ufffd")  # (an incomplete character may change)
    found = [text.find(s) for s in self._stops if s in text]
    if found:  # the answer is cut there: send up to it, then nothing more
      text, self._frozen = text[:min(found)], True
    else:
      text = text[:len(text) - self._held_back(text)]
    if not text.startswith(self.sent):  # (a detokenizer that rewrites earlier text)
      self._frozen = True
      return ""
    delta, self.sent = text[len(self.sent):], text
    return delta

  def _held_back(self, text: str) -> int:
    """The longest end of `text` that begins a stop string."""
    return max((n for s in self._stops for n in range(min(len(s) - 1, len(text)), 0, -1)
                if text.endswith(s[:n])), default=0)

  def rest(self, final: str) -> str:
    """What of the final answer `final` was not sent yet."""
    if not final.startswith(self.sent):
      raise AssertionError(f"the stream sent {self.sent!r}, not a prefix of the answer {final!r}")
    return final[len(self.sent):]
