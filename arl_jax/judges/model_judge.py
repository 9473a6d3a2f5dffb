"""A frozen Hugging Face model as a judge, run in this process.

The folder is imported as the policy's are (`models/hf_params.py`: any
family arl_jax imports), its tokenizer and chat template read from it. A
question is the judge's template filled in, asked as a user turn; the
verdict comes from the model's next-token distribution after the
assistant's turn prefix: each answer it counts (a yes or a no word, or a
score's digit: `JudgeConfig.answer_values`), by its first token with and
without a leading space, weighs its value by its probability (P(yes) /
(P(yes) + P(no)), or the expected score).

Questions are batched: environment worker threads call `verdict` (blocking)
as their rollouts finish, and one thread runs them `max_batch` at a time in
one jitted forward pass (rows right-padded to a power-of-two width, so a run
compiles a handful of shapes), on the configured device, off the learner's
critical path. A failure of the pass fails the questions it held, which
their environment calls count as faults.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import queue
import threading

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from arl_jax.envs import env_api, hf_tokenizer
from arl_jax.judges import judge_config
from arl_jax.models import decoder as decoder_lib
from arl_jax.models import hf_config, hf_params
from arl_jax.sharding import mesh_lib
from arl_jax.sharding import rules as rules_lib

_MIN_WIDTH = 64


def answer_ids(tokenizer, words) -> tuple[int, ...]:
  """The first token of each word, and of each with a leading space (a
  model may answer either way) unless that token is the space alone,
  without repeats."""
  space = set(tokenizer.encode(" ", add_bos=False))
  ids = []
  for word in words:
    for text in (word, " " + word):
      encoded = tokenizer.encode(text, add_bos=False)
      # (a vocabulary that spells the space apart starts every spaced word alike)
      if encoded and not (text[0] == " " and int(encoded[0]) in space):
        ids.append(int(encoded[0]))
  return tuple(dict.fromkeys(ids))


def answer_values(tokenizer, values: dict[str, float]) -> dict[int, float]:
  """Each counted answer's first token (`answer_ids`) and its value; two
  answers of different values may not share one."""
  out: dict[int, float] = {}
  for word, value in values.items():
    for token in answer_ids(tokenizer, [word]):
      if out.get(token, value) != value:
        raise ValueError(f"judge: answers of different values share a first token ({token}: "
                         f"{tokenizer.detokenize([token])!r}); choose other words")
      out[token] = value
  return out


class BatchedModel:
  """A frozen Hugging Face model on one device answering questions from
  many threads in batched, jitted passes. A subclass loads its model
  (`_load`), writes a question's tokens (`question_ids`) and turns a pass
  over a batch into one number per question (`outputs`)."""

  def __init__(self, cfg: judge_config.JudgeConfig):
    self.cfg = cfg
    self.tokenizer = hf_tokenizer.HfTokenizer(cfg.path, eos_token="auto", bos_token="auto",
                                              pad_token="auto", chat_template="auto")
    devices = jax.devices()
    if not 0 <= cfg.device < len(devices):
      raise ValueError(f"judge.device={cfg.device}: this process has {len(devices)} devices")
    mesh = mesh_lib.make_role_meshes(mesh_lib.MeshConfig(),
                                     devices=[devices[cfg.device]]).learner
    self._load(mesh)
    self._queue: queue.Queue = queue.Queue()
    self._closed = threading.Event()
    self.batches = 0  # forward passes run (for tests and metrics)
    self._thread = threading.Thread(target=self._serve, name="judge", daemon=True)
    self._thread.start()
    # A daemon thread inside a JAX call when the interpreter shuts down
    # aborts the process (seen: "terminate called ... FATAL: exception not
    # rethrown" after a judged run ended): stop it first.
    atexit.register(self.close)

  def _load(self, mesh) -> None:
    raise NotImplementedError

  def question_ids(self, prompt_text: str, completion_text: str) -> list[int]:
    raise NotImplementedError

  def outputs(self, tokens: np.ndarray, mask: np.ndarray, last: np.ndarray) -> np.ndarray:
    """One number per row of a padded batch (`last`: each row's last token)."""
    raise NotImplementedError

  def verdicts(self, questions: list[list[int]]) -> np.ndarray:
    """Each question's number, in one forward pass (rows right-padded)."""
    width = max(_MIN_WIDTH, 1 << (max(len(q) for q in questions) - 1).bit_length())
    rows = self.cfg.max_batch if len(questions) <= self.cfg.max_batch else len(questions)
    tokens = np.full((rows, width), self.tokenizer.pad_id, np.int32)
    mask = np.zeros((rows, width), bool)
    last = np.zeros((rows,), np.int32)
    for i, q in enumerate(questions):
      tokens[i, :len(q)], mask[i, :len(q)], last[i] = q, True, len(q) - 1
    mask[len(questions):, 0] = True  # (filler rows: one token, ignored)
    return self.outputs(tokens, mask, last)[:len(questions)]

  def verdict(self, prompt_text: str, completion_text: str) -> float:
    """Blocks until the batch holding this question has run."""
    question = self.question_ids(prompt_text, completion_text)
    if len(question) > self.cfg.max_len:
      raise ValueError(f"the judge's question has {len(question)} tokens, more than "
                       f"judge.max_len={self.cfg.max_len}")
    if self._closed.is_set():
      raise RuntimeError("the judge was closed")
    future: concurrent.futures.Future = concurrent.futures.Future()
    self._queue.put((question, future))
    return float(future.result())

  def _serve(self) -> None:
    while not self._closed.is_set():
      try:
        first = self._queue.get(timeout=0.1)
      except queue.Empty:
        continue
      batch = [first]
      while len(batch) < self.cfg.max_batch:  # (whatever else is waiting joins it)
        try:
          batch.append(self._queue.get_nowait())
        except queue.Empty:
          break
      try:
        results = self.verdicts([q for q, _ in batch])
      except Exception as e:  # noqa: BLE001 - each waiting call raises it
        for _, future in batch:
          future.set_exception(e)
        continue
      self.batches += 1
      for (_, future), p in zip(batch, results):
        future.set_result(p)

  def close(self) -> None:
    if self._closed.is_set() and not self._thread.is_alive():
      return
    self._closed.set()
    self._thread.join(timeout=5)
    while not self._queue.empty():
      self._queue.get_nowait()[1].set_exception(RuntimeError("the judge was closed"))


class ModelJudge(BatchedModel):
  """Answers questions from a frozen model's next-token distribution (see
  the module docstring)."""

  def _load(self, mesh) -> None:
    values = answer_values(self.tokenizer, self.cfg.answer_values())
    self.answer_ids = np.array(list(values), np.int32)
    self.answer_values = np.array(list(values.values()), np.float64)
    self.model_cfg = hf_config.model_config_from_hf(hf_config.read_config(self.cfg.path))
    self._graphdef, self._params = hf_params.load_params(
        self.cfg.path, self.model_cfg, mesh, rules_lib.LEARNER_RULES)
    self._forward = jax.jit(self._last_logprobs)

  def question_ids(self, prompt_text: str, completion_text: str) -> list[int]:
    return env_api.encode_user_prompt(self.tokenizer, self.cfg.question(prompt_text,
                                                                        completion_text))

  def _last_logprobs(self, params, tokens, mask, last):
    model = nnx.merge(self._graphdef, params)
    hidden, _ = model(tokens, decoder_lib.positions_from_mask(mask),
                      decoder_lib.causal_mask(mask), hidden_only=True)
    at_last = jnp.take_along_axis(hidden, last[:, None, None], axis=1)
    logits = decoder_lib.head_logits(at_last, model.head_weight())[:, 0]
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)

  def outputs(self, tokens, mask, last) -> np.ndarray:
    logprobs = np.asarray(self._forward(self._params, tokens, mask, last), np.float64)
    probs = np.exp(logprobs[:, self.answer_ids])
    return (probs @ self.answer_values) / np.maximum(probs.sum(axis=1), 1e-300)
