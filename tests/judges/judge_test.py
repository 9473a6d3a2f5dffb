"""Model judges: a Hugging Face judge's verdict equals P(yes) / (P(yes) +
P(no)), or the expected score, computed directly with transformers, batched
across threads; a sequence-classification reward model's equals
transformers' score; an OpenAI-compatible judge reads its server's top
log-probs and names every way it can fail; a judged run logs the rule and
judge parts of its reward."""

import concurrent.futures
import json
import math
import os
import shutil

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


CASES = [("What is 2+2?", "4"), ("Name a colour.", "Blue, I think, or maybe green."),
         ("Say hi.", ""), ("A longer task " * 20, "a longer answer " * 15),
         ("Why?", "Because."), ("Count to three.", "one two three")]


@pytest.mark.parametrize("verdict", ["yes_no", "score"])
def test_a_model_judge_s_verdict_is_the_model_s_probability_of_yes(judge_folder, verdict):
  """yes_no: P(yes) / (P(yes) + P(no)); score: the expected digit / 9."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from arl_jax.judges import model_judge  # noqa: PLC0415

  judge = model_judge.ModelJudge(judge_config.JudgeConfig(kind="hf", path=judge_folder,
                                                          max_batch=4, verdict=verdict))
  words = ({"Yes": 1.0, "yes": 1.0, "No": 0.0, "no": 0.0} if verdict == "yes_no"
           else {str(d): d / 9 for d in range(10)})
  ids = {}
  for word, value in words.items():  # (each word's first token, with a leading space too)
    for text in (word, " " + word):
      encoded = judge.tokenizer.encode(text, add_bos=False)
      if not (text[0] == " " and encoded[0] in judge.tokenizer.encode(" ", add_bos=False)):
        ids[encoded[0]] = value
  assert dict(zip(judge.answer_ids.tolist(), judge.answer_values.tolist())) == ids
  reference = transformers.AutoModelForCausalLM.from_pretrained(
      judge_folder, torch_dtype=torch.float32).eval()
  cases = CASES

  def direct(prompt, completion):
    question = judge.question_ids(prompt, completion)
    with torch.no_grad():
      logits = reference(torch.tensor([question])).logits[0, -1].double()
    p = torch.softmax(logits, -1).numpy()
    return sum(p[i] * v for i, v in ids.items()) / sum(p[i] for i in ids)

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


def test_a_reward_model_s_verdict_is_transformers_score(judge_folder, tmp_path):
  """A LlamaForSequenceClassification folder (the judge's decoder with a
  random score head) scores each conversation as transformers does."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from arl_jax.judges import reward_model  # noqa: PLC0415

  folder = tmp_path / "rm"
  config = transformers.AutoConfig.from_pretrained(judge_folder, num_labels=1)
  config.architectures = ["LlamaForSequenceClassification"]
  torch.manual_seed(0)
  base = transformers.AutoModelForCausalLM.from_pretrained(judge_folder,
                                                           torch_dtype=torch.float32)
  rm = transformers.LlamaForSequenceClassification(config).eval()
  rm.model.load_state_dict(base.model.state_dict())
  rm.save_pretrained(folder, safe_serialization=True)
  for name in os.listdir(judge_folder):  # (the tokenizer's files)
    if name.startswith(("tokenizer", "special_tokens")):
      shutil.copy(os.path.join(judge_folder, name), folder / name)
  judge = reward_model.RewardModel(judge_config.JudgeConfig(kind="reward_model",
                                                            path=str(folder), max_batch=4))
  with concurrent.futures.ThreadPoolExecutor(len(CASES)) as pool:
    scores = list(pool.map(lambda c: judge.verdict(*c), CASES))
  for case, score in zip(CASES, scores):
    ids = judge.question_ids(*case)
    assert ids[-1] != judge.tokenizer.pad_id
    with torch.no_grad():
      want = float(rm(torch.tensor([ids])).logits[0, 0])
    assert score == pytest.approx(want, abs=2e-5), case
  assert len(set(np.round(scores, 4))) > 1 and 0 < judge.batches < len(CASES)
  judge.close()


def test_a_reward_model_folder_of_another_kind_is_refused_by_name(judge_folder):
  from arl_jax.judges import reward_model  # noqa: PLC0415
  from arl_jax.models import hf_config  # noqa: PLC0415

  with pytest.raises(hf_config.HfConfigError, match="is not a reward model"):
    reward_model.RewardModel(judge_config.JudgeConfig(kind="reward_model", path=judge_folder))
  with pytest.raises(hf_config.HfConfigError, match="3 labels"):
    reward_model.decoder_config({"architectures": ["LlamaForSequenceClassification"],
                                 "num_labels": 3}, "f")


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


def test_an_openai_judge_s_score_is_the_expected_digit():
  server = _server(lambda body: (200, _completion([("7", math.log(0.5)), (" 9", math.log(0.25)),
                                                   ("x", -1.0), ("3", math.log(0.25))])))
  try:
    judge = openai_judge.OpenAIJudge(judge_config.JudgeConfig(
        kind="openai", url=server.url_v1, verdict="score", max_score=9))
    assert judge.verdict("Task", "answer") == pytest.approx((0.5 * 7 + 0.25 * 9 + 0.25 * 3) / 9)
    question = server.requests[0][2]["messages"][0]["content"]
    assert "from 0 (wrong) to 9" in question and "answer" in question
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
                          (dict(kind="reward_model"), "judge.path must name"),
                          (dict(verdict="stars"), "judge.verdict must be one of"),
                          (dict(verdict="score", max_score=10), "judge.max_score must be"),
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
