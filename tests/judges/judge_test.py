"""Model judges: a Hugging Face judge's verdict equals P(yes) / (P(yes) +
P(no)) computed directly with transformers, batched across threads; an
OpenAI-compatible judge reads its server's top log-probs and names every
way it can fail; a judged run logs the rule and judge parts of its reward."""

import concurrent.futures
import json
import math

import numpy as np
import pytest

from arl_jax.config import run_spec
from arl_jax.envs import env_api
from arl_jax.judges import judge_config, judged_env, openai_judge
from arl_jax.testing import json_server, tiny
from arl_jax.training import run_lib


@pytest.fixture(scope="module")
def judge_folder(tmp_path_factory):
  pytest.importorskip("gguf")
  from arl_jax.models import gguf_convert  # noqa: PLC0415
  from arl_jax.testing import gguf_files  # noqa: PLC0415

  root = tmp_path_factory.mktemp("judge")
  gguf_files.write_llama(str(root / "m.gguf"), "F32", d_model=64, num_heads=2, num_kv_heads=1,
                         mlp_dim=64, num_layers=2)
  gguf_convert.convert(str(root / "m.gguf"), str(root / "hf"))
  return str(root / "hf")


def test_a_model_judge_s_verdict_is_the_model_s_probability_of_yes(judge_folder):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from arl_jax.judges import model_judge  # noqa: PLC0415

  judge = model_judge.ModelJudge(judge_config.JudgeConfig(kind="hf", path=judge_folder,
                                                          max_batch=4))
  assert judge.yes_ids and judge.no_ids and not set(judge.yes_ids) & set(judge.no_ids)
  reference = transformers.AutoModelForCausalLM.from_pretrained(
      judge_folder, torch_dtype=torch.float32).eval()
  cases = [("What is 2+2?", "4"), ("Name a colour.", "Blue, I think, or maybe green."),
           ("Say hi.", ""), ("A longer task " * 20, "a longer answer " * 15),
           ("Why?", "Because."), ("Count to three.", "one two three")]

  def direct(prompt, completion):
    ids = judge.question_ids(prompt, completion)
    with torch.no_grad():
      logits = reference(torch.tensor([ids])).logits[0, -1].double()
    p = torch.softmax(logits, -1).numpy()
    yes, no = p[list(judge.yes_ids)].sum(), p[list(judge.no_ids)].sum()
    return yes / (yes + no)

  with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:  # (batched together)
    verdicts = list(pool.map(lambda c: judge.verdict(*c), cases))
  for case, verdict in zip(cases, verdicts):
    assert verdict == pytest.approx(direct(*case), abs=2e-5), case
  assert 0 < judge.batches < len(cases)
  with pytest.raises(ValueError, match="judge.max_len"):
    judge.verdict("x " * 2000, "y")
  judge.close()
  with pytest.raises(RuntimeError, match="closed"):
    judge.verdict("a", "b")


def _server(answer_fn):
  """A stand-in judge server; its `url` ends in /v1, as a client is given."""
  server = json_server.JsonServer(answer_fn)
  server.url_v1 = server.url + "/v1"
  return server


def _completion(candidates):
  return json.dumps({"choices": [{"logprobs": {"content": [{
      "token": candidates[0][0], "logprob": candidates[0][1],
      "top_logprobs": [{"token": t, "logprob": lp} for t, lp in candidates]}]}}]}).encode()


def _answers_by_completion(body):
  """Says Yes (p=0.6 against No 0.2) when the completion holds "right"."""
  right = "right" in body["messages"][0]["content"].split("Answer:")[1]
  yes, no = (0.6, 0.2) if right else (0.1, 0.7)
  return 200, _completion([(" Yes", math.log(yes)), ("No", math.log(no)), ("Maybe", -3.0)])


def test_an_openai_judge_reads_its_server_s_top_log_probs(monkeypatch):
  server = _server(_answers_by_completion)
  monkeypatch.setenv("JUDGE_KEY", "s3cret")
  try:
    judge = openai_judge.OpenAIJudge(judge_config.JudgeConfig(
        kind="openai", url=server.url_v1, model="judge-7b", api_key_env="JUDGE_KEY"))
    assert judge.verdict("Task", "the right answer") == pytest.approx(0.75)
    assert judge.verdict("Task", "wrong") == pytest.approx(0.125)
    path, _, body = server.requests[0]
    assert path == "/v1/chat/completions" and body["model"] == "judge-7b"
    assert body["max_tokens"] == 1 and body["top_logprobs"] == 20 and body["temperature"] == 0
  finally:
    server.stop()


@pytest.mark.parametrize("answer, message", [
    ((500, b"overloaded"), "answered HTTP 500: overloaded"),
    ((200, b"not json"), "no chat completion with top_logprobs"),
    ((200, _completion([("Maybe", -0.1), ("Perhaps", -2.0)])), "none of the judge's top"),
])
def test_an_openai_judge_that_cannot_answer_is_a_judge_error(answer, message):
  server = _server(lambda body: answer)
  try:
    judge = openai_judge.OpenAIJudge(judge_config.JudgeConfig(kind="openai", url=server.url_v1))
    with pytest.raises(openai_judge.JudgeError, match=message):
      judge.verdict("t", "c")
  finally:
    server.stop()


def test_an_oversized_answer_or_a_server_that_is_down_is_a_judge_error():
  server = _server(lambda body: (200, b"x" * ((1 << 20) + 10)))
  judge = openai_judge.OpenAIJudge(judge_config.JudgeConfig(kind="openai", url=server.url_v1))
  try:
    with pytest.raises(openai_judge.JudgeError, match="more than 1 MiB"):
      judge.verdict("t", "c")
  finally:
    server.stop()
  with pytest.raises(openai_judge.JudgeError, match="refused"):
    judge.verdict("t", "c")


def test_a_judge_config_names_its_bad_keys(monkeypatch):
  for fields, message in [(dict(kind="gpt"), "judge.kind must be one of"),
                          (dict(kind="hf"), "judge.path must name"),
                          (dict(kind="openai", url="ftp://x"), "judge.url must be an http"),
                          (dict(template="no placeholders"), r"judge.template must hold"),
                          (dict(max_batch=0), "judge.max_batch must be"),
                          (dict(template='{prompt} {completion} as {"score": 1}'),
                           "judge.template: KeyError")]:
    with pytest.raises(ValueError, match=message):
      judge_config.JudgeConfig(**fields)
  monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
  config = tiny.load_config("arith", "tiny")
  config.judge.update(kind="openai", url="http://127.0.0.1:9/v1", api_key_env="NO_SUCH_KEY_VAR")
  with pytest.raises(run_spec.ConfigError, match=r"config.judge: .*NO_SUCH_KEY_VAR is not set"):
    run_spec.build(config)


class _Fixed(env_api.Environment):
  name = "fixed"

  def encode_prompt(self, prompt):
    return [1, 2]

  def score(self, prompt, completion_ids):
    return env_api.Score(0.5, {"own": 2.0}, outcome="fine")


class _FakeJudge:
  def __init__(self, verdict):
    self._verdict, self.asked = verdict, []

  def verdict(self, prompt, completion):
    self.asked.append((prompt, completion))
    if isinstance(self._verdict, Exception):
      raise self._verdict
    return self._verdict


def test_a_judged_reward_is_the_weighted_sum_with_its_parts():
  from arl_jax.envs import tokenizer as tokenizer_lib  # noqa: PLC0415

  tokenizer = tokenizer_lib.make_tokenizer(tokenizer_lib.TokenizerConfig(kind="byte"))
  cfg = judge_config.JudgeConfig(kind="openai", url="http://x", weight=2.0, rule_weight=0.5)
  judge = _FakeJudge(0.25)
  env = judged_env.JudgedEnvironment(_Fixed(), judge, cfg, tokenizer)
  prompt = env_api.TextPrompt(prompt_id=1, text="the task", answer="")
  score = env.score(prompt, tokenizer.encode("an answer") + [tokenizer.eos_id])
  assert score.reward == pytest.approx(0.5 * 0.5 + 2.0 * 0.25)
  assert score.parts == {"own": 2.0, "rule": 0.5, "judge": 0.25} and score.outcome == "fine"
  assert judge.asked == [("the task", "an answer")]
  failing = judged_env.JudgedEnvironment(_Fixed(), _FakeJudge(RuntimeError("down")), cfg,
                                         tokenizer)
  with pytest.raises(RuntimeError, match="down"):  # (the env runner counts it as a fault)
    failing.score(prompt, [1])


def test_a_run_judged_by_a_server_logs_both_parts_of_its_reward(tmp_path):
  server = _server(_answers_by_completion)
  try:
    config = tiny.load_config("arith", "tiny")
    config.eval_every = 0
    config.judge.update(kind="openai", url=server.url_v1, weight=0.5)
    result = run_lib.run(config, str(tmp_path), print_fn=lambda _: None)
  finally:
    server.stop()
  assert result.complete
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  rl = [r for r in rows if r.get("phase") == "rl" and "loss" in r]
  for r in rl:
    parts = r["reward_parts"]["arith"]
    assert parts["judge"] == pytest.approx(0.125)  # (no completion says "right")
    assert r["reward_mean"] == pytest.approx(parts["rule"] + 0.5 * parts["judge"])
  assert rl[-1]["env_errors"] == 0 and len(server.requests) >= len(rl) * 16
  assert np.isfinite([r["loss"] for r in rl]).all()
