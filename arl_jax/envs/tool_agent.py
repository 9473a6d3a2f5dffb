"""`tool_agent`: a multi-turn task whose tool answers after a heavy-tailed delay.

The prompt names a key (`"k37?"`); its value lives only behind a lookup tool.
The reward is 1 for the exact value, so it is verifiable, and held-out keys
can only be answered through the tool. The protocol follows the tokenizer's
chat template:

- no template (the byte tokenizer): the policy calls the tool by writing
  `[37]` (the `]` ends the segment), the environment answers `=482;`
  (observation tokens, loss mask 0), and the policy writes the value and EOS:
  `[37]=482;482<eos>`.
- a chat template (e.g. chatml): the policy ends its turn after the call,
  `[37]<|im_end|>`; the answer arrives as a `tool` turn followed by the
  assistant's turn prefix, `\n<|im_start|>tool\n=482;<|im_end|>\n<|im_start|>assistant\n`;
  the policy answers `482<|im_end|>`. Turns end on the end-of-turn token, so a
  BPE vocabulary that merges `]` with other characters changes nothing.

The tool's latency is lognormal: it has a long tail (minutes in real agents,
scaled down here for CPU runs), so an episode outlives weight updates and its
segments are sampled by different policy versions. This is the workload
asynchronous RL exists for.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import threading
import time
import zlib

import numpy as np

from arl_jax.envs import env_api
from arl_jax.envs import tokenizer as tokenizer_lib

CALL_OPEN, CALL_CLOSE, ANSWER_OPEN, ANSWER_CLOSE = "[", "]", "=", ";"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToolAgentConfig:
  """Attributes:
    num_keys: keys are 0..num_keys-1.
    max_value: values are drawn from [0, max_value].
    table_seed: seed of the key -> value table.
    heldout_fraction: share of keys reserved for evaluation.
    max_calls: tool calls answered per episode; later calls end it.
    latency_median_s: median tool latency (seconds).
    latency_p99_s: 99th percentile of the latency; with the median it sets
      the lognormal's sigma. Equal to the median: a constant latency.
    latency_max_s: latencies are capped here (a tool-side timeout).
  """

  num_keys: int = 100
  max_value: int = 999
  table_seed: int = 0
  heldout_fraction: float = 0.1
  max_calls: int = 2
  latency_median_s: float = 0.05
  latency_p99_s: float = 0.5
  latency_max_s: float = 2.0

  def __post_init__(self):
    if self.num_keys < 2:
      raise ValueError(f"env.num_keys must be >= 2, got {self.num_keys}")
    if self.max_value < 0:
      raise ValueError(f"env.max_value must be >= 0, got {self.max_value}")
    if not 0.0 < self.heldout_fraction < 1.0:
      raise ValueError(f"env.heldout_fraction must be in (0, 1), got {self.heldout_fraction}")
    if self.max_calls < 1:
      raise ValueError(f"env.max_calls must be >= 1, got {self.max_calls}")
    if self.latency_median_s < 0 or self.latency_p99_s < self.latency_median_s:
      raise ValueError("env.latency_p99_s must be >= env.latency_median_s >= 0, got "
                       f"{self.latency_p99_s} and {self.latency_median_s}")
    if self.latency_max_s < self.latency_median_s:
      raise ValueError(f"env.latency_max_s={self.latency_max_s} is below "
                       f"env.latency_median_s={self.latency_median_s}")


class LognormalLatency:
  """Tool latency: lognormal with a given median and 99th percentile, capped."""

  def __init__(self, median_s: float, p99_s: float, max_s: float, seed: int = 0):
    self.median_s, self.max_s = median_s, max_s
    z99 = statistics.NormalDist().inv_cdf(0.99)
    self.sigma = math.log(p99_s / median_s) / z99 if median_s > 0 and p99_s > median_s else 0.0
    self._rng = np.random.default_rng(seed)
    self._lock = threading.Lock()  # tool calls come from many worker threads

  def quantile(self, q: float) -> float:
    """The configured q-quantile (after the cap)."""
    if self.median_s == 0:
      return 0.0
    z = statistics.NormalDist().inv_cdf(q)
    return min(self.median_s * math.exp(self.sigma * z), self.max_s)

  def sample(self, size: int | None = None):
    with self._lock:
      draws = self._rng.lognormal(math.log(self.median_s), self.sigma, size) \
          if self.median_s > 0 else np.zeros(size or ())
    capped = np.minimum(draws, self.max_s)
    return float(capped) if size is None else capped


# One task instance; `prompt_id` is the key, stable across runs.
Prompt = env_api.TextPrompt


def value_of(cfg: ToolAgentConfig, key: int) -> int:
  """The table: a hash, so it needs no storage and no RNG state."""
  return zlib.crc32(f"{cfg.table_seed}:{key}".encode()) % (cfg.max_value + 1)


def _is_heldout(key: int, fraction: float) -> bool:
  return zlib.crc32(f"heldout:{key}".encode()) % 10_000 < fraction * 10_000


def make_prompts(cfg: ToolAgentConfig, split: str) -> list[Prompt]:
  if split not in env_api.SPLITS:
    raise ValueError(f"split must be one of {env_api.SPLITS}, got {split!r}")
  want_heldout = split == "heldout"
  return [Prompt(prompt_id=k, text=f"k{k}?", answer=str(value_of(cfg, k)))
          for k in range(cfg.num_keys) if _is_heldout(k, cfg.heldout_fraction) == want_heldout]


class ToolAgentEnv(env_api.MultiTurnEnvironment):
  """The lookup-tool agent task (see the module docstring)."""

  name = "tool_agent"

  def __init__(self, cfg: ToolAgentConfig, tokenizer: tokenizer_lib.Tokenizer,
               for_eval: bool = False):
    self._cfg = cfg
    self._tokenizer = tokenizer
    self._chat = tokenizer.template.is_chat
    # In chat, the tokenizer's end-of-turn token ends every turn (the sampler
    # stops on it anyway); without a template the call's `]` ends a segment.
    self.stop_ids = () if self._chat else tuple(tokenizer.encode(CALL_CLOSE))
    # Ids that open each assistant turn after an observation (chat only).
    self._assistant_prefix = tokenizer.encode(tokenizer.template.assistant_prefix())
    median = 0.0 if for_eval else cfg.latency_median_s  # evaluation does not wait on tools
    self.latency = LognormalLatency(median, max(cfg.latency_p99_s, median), cfg.latency_max_s,
                                    seed=cfg.table_seed)

  def encode_prompt(self, prompt: Prompt) -> list[int]:
    return env_api.encode_user_prompt(self._tokenizer, prompt.text)

  def _turn_starts(self, ids: list[int]) -> list[int]:
    """Where each assistant turn after an observation starts (chat only)."""
    prefix, n = self._assistant_prefix, len(self._assistant_prefix)
    return [i + n for i in range(len(ids) - n + 1) if ids[i:i + n] == prefix]

  def _last_turn_text(self, ids: list[int]) -> str:
    """The text of the policy's last turn (its final stop token dropped)."""
    if self._chat:
      starts = self._turn_starts(ids)
      return self._tokenizer.decode(ids[starts[-1] if starts else 0:-1])
    text = self._tokenizer.decode(ids)
    return text[text.rfind(ANSWER_CLOSE) + 1:] if ANSWER_CLOSE in text else text

  def _tool_call(self, ids: list[int]) -> tuple[str, int] | None:
    """`(key text, calls so far)` if the segment that just ended is a tool call."""
    if self._chat:
      if ids[-1] != self._tokenizer.end_of_turn_id:
        return None  # EOS (when distinct from the end of turn) ends the episode
      turn = self._last_turn_text(ids).strip()
      if not (turn.startswith(CALL_OPEN) and turn.endswith(CALL_CLOSE)):
        return None  # an answer turn ends the episode
      return turn[1:-1], len(self._turn_starts(ids)) + 1
    if ids[-1] != self.stop_ids[0]:
      return None  # EOS (the answer) or anything else ends the episode
    text = self._tokenizer.decode(ids)
    call = text[text.rfind(CALL_OPEN) + 1:-1] if CALL_OPEN in text else ""
    return call, text.count(CALL_CLOSE)

  def _observation(self, result: str) -> list[int]:
    return self._tokenizer.encode(
        self._tokenizer.template.observation("tool", f"{ANSWER_OPEN}{result}{ANSWER_CLOSE}"))

  @property
  def max_calls(self) -> int:
    """Tool calls answered per episode (later ones end it)."""
    return self._cfg.max_calls

  def lookup(self, key: str) -> str:
    """The tool: the value of `key` (digits), or "?" for no such key, after
    its latency (a blocking call, as a real one)."""
    time.sleep(self.latency.sample())
    known = key.isascii() and key.isdigit() and int(key) < self._cfg.num_keys
    return str(value_of(self._cfg, int(key))) if known else "?"

  def step(self, prompt: Prompt, completion_ids) -> list[int] | None:
    ids = [int(i) for i in completion_ids]
    call = self._tool_call(ids) if ids else None
    if call is None or call[1] > self._cfg.max_calls:
      return None
    return self._observation(self.lookup(call[0]))

  def score(self, prompt: Prompt, completion_ids) -> float:
    ids = [int(i) for i in completion_ids]
    # The episode must end on the answer's own stop token: an answer cut off
    # by the length limit is wrong even if its digits match, and so is a call
    # left unanswered when the tool budget ran out.
    if not ids or ids[-1] not in self._tokenizer.stop_ids:
      return 0.0
    return float(self._last_turn_text(ids).strip() == prompt.answer)

  def demonstration(self, prompt: Prompt) -> env_api.Demonstration:
    """The ideal episode, for supervised warm-up (observation tokens masked)."""
    end = [self._tokenizer.end_of_turn_id] if self._chat else []
    call = [*self._tokenizer.encode(f"{CALL_OPEN}{prompt.prompt_id}{CALL_CLOSE}"), *end]
    observation = self._observation(prompt.answer)
    answer = [*self._tokenizer.encode(prompt.answer), self._tokenizer.end_of_turn_id]
    return env_api.Demonstration(
        completion_ids=(*call, *observation, *answer),
        loss_mask=(1.0,) * len(call) + (0.0,) * len(observation) + (1.0,) * len(answer))
