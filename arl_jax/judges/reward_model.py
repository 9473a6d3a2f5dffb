"""A sequence-classification reward model as a judge (`judge.kind =
"reward_model"`): a Hugging Face `LlamaForSequenceClassification` (or Qwen2,
Qwen3) folder with one label, the decoder arl_jax imports plus a score head.

The conversation (the task as a user turn, the completion as the
assistant's) is rendered by the reward model's own chat template; the
verdict is the score head applied to the last token's final hidden state,
as transformers computes it for an unpadded sequence: an unbounded number
(`judge.weight` scales it into the reward). Questions from concurrent
environment workers are batched as the `hf` judge's are (`model_judge.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from arl_jax.envs import env_api
from arl_jax.judges import model_judge
from arl_jax.models import decoder as decoder_lib
from arl_jax.models import hf_config, hf_params
from arl_jax.sharding import rules as rules_lib

_SCORE = "score.weight"


def decoder_config(hf: dict, path: str) -> dict:
  """`hf` (a reward model's config.json) as its decoder's: the causal-LM
  architecture of the same family and a tied head (the reward model stores
  no `lm_head`; its output is the score head's). Raises for another
  architecture or more than one label."""
  arch = (hf.get("architectures") or [""])[0]
  causal = arch.replace("ForSequenceClassification", "ForCausalLM")
  if not arch.endswith("ForSequenceClassification") or causal not in hf_config.ARCHITECTURES:
    supported = sorted(a.replace("ForCausalLM", "ForSequenceClassification")
                       for a in hf_config.ARCHITECTURES)
    raise hf_config.HfConfigError(f"{path}/config.json: architecture {arch!r} is not a reward "
                                  f"model arl_jax imports; supported: {supported}")
  labels = hf.get("num_labels", len(hf.get("id2label") or {}) or 1)
  if labels != 1:
    raise hf_config.HfConfigError(f"{path}/config.json: {labels} labels; a reward model gives "
                                  "one score (num_labels 1)")
  return {**hf, "architectures": [causal], "tie_word_embeddings": True}


class RewardModel(model_judge.BatchedModel):
  """Scores conversations with a sequence-classification model's head."""

  def _load(self, mesh) -> None:
    hf = decoder_config(hf_config.read_config(self.cfg.path), self.cfg.path)
    self.model_cfg = hf_config.model_config_from_hf(hf, where=f"{self.cfg.path}/config.json")
    self._graphdef, self._params = hf_params.load_params(
        self.cfg.path, self.model_cfg, mesh, rules_lib.LEARNER_RULES, beside=(_SCORE,))
    source = hf_params.SafetensorsFolder(self.cfg.path)
    if _SCORE not in source.files:
      raise FileNotFoundError(f"{self.cfg.path}: no {_SCORE} (the reward model's score head)")
    score = np.asarray(source.read(_SCORE), np.float32)
    if score.shape != (1, self.model_cfg.d_model):
      raise hf_config.HfConfigError(f"{self.cfg.path}: {_SCORE} has shape {score.shape}; a "
                                    f"reward model's is (1, {self.model_cfg.d_model})")
    self._score = jax.device_put(score[0], mesh.devices.flat[0])
    self._forward = jax.jit(self._last_scores)

  def question_ids(self, prompt_text: str, completion_text: str) -> list[int]:
    messages = [{"role": "user", "content": prompt_text},
                {"role": "assistant", "content": completion_text}]
    if not self.tokenizer.template.is_chat:
      raise ValueError(f"judge.path={self.cfg.path}: the reward model's tokenizer has no chat "
                       "template to render the conversation with")
    return env_api.encode_messages(self.tokenizer, messages, add_generation_prompt=False)

  def _last_scores(self, params, score, tokens, mask, last):
    model = nnx.merge(self._graphdef, params)
    hidden, _ = model(tokens, decoder_lib.positions_from_mask(mask),
                      decoder_lib.causal_mask(mask), hidden_only=True)
    at_last = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    return at_last.astype(jnp.float32) @ score

  def outputs(self, tokens, mask, last) -> np.ndarray:
    return np.asarray(self._forward(self._params, self._score, tokens, mask, last), np.float64)
