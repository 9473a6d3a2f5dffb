"""`TextStream`: what a stream sends is always a prefix of the final answer."""

from arl_jax.gateway import streaming

STOP = 99


def _text(ids):  # one character a token; 0 is half a character
  return "".join("\ufffd" if i == 0 else chr(ord("a") + i % 26) for i in ids if i != STOP)


def _stream(stops=(), live=True):
  return streaming.TextStream(_text, stops=stops, stop_ids={STOP}, live=live)


def test_deltas_add_up_to_the_answer():
  stream, sent = _stream(), ""
  tokens = [1, 2, 3, 4, 5, STOP]
  for n in range(1, len(tokens) + 1):
    sent += stream.update(tokens[:n])
  assert sent == "bcdef" and stream.rest("bcdef") == ""


def test_a_possible_stop_string_is_held_back_and_a_found_one_ends_the_stream():
  stream = _stream(stops=["cdx"])
  assert stream.update([1]) == "b"
  assert stream.update([1, 2]) == ""  # "c" may begin "cdx"
  assert stream.update([1, 2, 3]) == ""  # "cd" may too
  assert stream.update([1, 2, 3, 4]) == "cde"  # it did not
  stream = _stream(stops=["de"])
  assert stream.update([1, 2, 3, 4, 5]) == "bc"  # cut before "de", then nothing more
  assert stream.update([1, 2, 3, 4, 5, 6]) == ""
  assert stream.rest("bc") == ""


def test_an_incomplete_character_and_a_final_stop_token_wait():
  stream = _stream()
  assert stream.update([1, 0]) == "b"
  assert stream.update([1, 0, STOP]) == ""
  assert stream.rest("b\ufffd") == "\ufffd"  # (the final answer says what it is)


def test_a_late_older_update_is_ignored_and_a_stream_not_live_sends_all_at_the_end():
  stream = _stream()
  assert stream.update([1, 2, 3]) == "bcd"
  assert stream.update([1, 2]) == ""
  assert stream.update([1, 2, 3, 4]) == "e"
  quiet = _stream(live=False)
  assert quiet.update([1, 2, 3]) == "" and quiet.rest("bcd") == "bcd"
