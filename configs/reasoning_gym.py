r"""Asynchronous GRPO on reasoning-gym's procedural tasks.

Commands (`pip install -e ".[reasoning-gym]"` first):

  python -m arl_jax.launch --config=configs/reasoning_gym.py:chain_sum --workdir=/tmp/rg
  python -m arl_jax.launch --config=configs/reasoning_gym.py:chain_sum,gcd:/tmp/smollm2 \
      --config.env.tasks.chain_sum.max_terms=3 --config.env.tasks.gcd.weight=0.5 \
      --workdir=/tmp/rg_smollm2

The argument is `TASK[,TASK...]` (any of reasoning-gym's tasks by name; a
mistyped one is refused with the list), then optionally `:FOLDER` (a Hugging
Face chat model folder, as `configs/smollm2.py` converts; its settings) or
`:tiny` (a few updates of a tiny model, for tests). Each task's own config
keys are under `env.tasks.TASK` at reasoning-gym's defaults, beside its
sampling `weight` (1); `env.size` training questions are split between the
tasks by weight, and `env.heldout_size` held-out questions per task (from
another seed, none of them a training question) are what evaluation scores
(each task's accuracy logged apart: `eval_reward_by_env`). A task of weight
0 is evaluated and never trained on: what training did to a related task.
The reward is the task's own scorer on the answer the completion gives
between `<answer>` tags (`env.answer_format`). `--config.env.curriculum.enabled=True`
draws training questions at each task's difficulty level, moved by the
measured reward (keys under `env.curriculum`: window, promote_at, demote_at,
start_level).

What to expect from SmolLM2-135M-Instruct (`configs/smollm2.py`'s folder;
2026-12-07, this 2-core CPU): trained on chain_sum (two terms of one
digit), with basic_arithmetic (two terms of one digit; +, -, *, / and
negative numbers) held out whole as a related task it never trains on, the
last number of a completion as its answer, sampled at temperature 0.6:

  python -m arl_jax.launch \
      --config=configs/reasoning_gym.py:chain_sum,basic_arithmetic:/tmp/smollm2 \
      --config.env.answer_format=last_number \
      --config.env.tasks.chain_sum.max_terms=2 --config.env.tasks.chain_sum.max_digits=1 \
      --config.env.tasks.basic_arithmetic.max_terms=2 \
      --config.env.tasks.basic_arithmetic.max_digits=1 \
      --config.env.tasks.basic_arithmetic.weight=0 --config.eval_size=400 \
      --config.sampler.temperature=0.6 --config.sampler.max_new_tokens=64 \
      --config.sampler.prompt_len=128 "--config.sampler.prompt_buckets=(64,)" \
      --config.num_steps=20 --config.eval_every=20 --workdir=/tmp/rg_smollm2

Greedy accuracy on the 200 held-out questions of each task (standard
errors), beside what trivial policies score on the same questions:

  | task                      | before         | seed 0         | seed 1         |
  | chain_sum (trained)       | 0.195 +- 0.028 | 0.685 +- 0.033 | 0.645 +- 0.034 |
  | basic_arithmetic (unseen) | 0.340 +- 0.033 | 0.359 +- 0.034 | 0.369 +- 0.034 |

("seed N": after 20 updates.) The trivial policies on the same questions:
chain_sum 0.075 (the first number in the question), 0.025 (the best
constant, "5"), 0.043 (a random training answer); basic_arithmetic 0.147,
0.100 ("0"), 0.063 (`benchmarks/reasoning_gym_survey.py`).

chain_sum gains 0.49 and 0.45: 17 and 16 standard errors of the starting
accuracy (11 and 10 of the difference, both errors counted), far above
every trivial line; the unseen basic_arithmetic does not get
worse (+0.02, +0.03: within noise). What the model learned is the sums,
not only a format: a policy with the right format and a random value
scores 0.043. The exported models (`python -m arl_jax.export_hf`) score
exactly the same in transformers, prompted with the model's own chat
template (`python benchmarks/transformers_eval.py --folder=EXPORTED
--workdir=/tmp/rg_smollm2 --formats=model`: 0.685 / 0.359 and 0.645 /
0.369). Wall time: 22-23 minutes to the update-20 evaluation
(start-up 211-233 s, most of it the first evaluation of 400 questions;
35-39 s an update, median; two evaluations of ~3.5 minutes each). Peak
resident memory 19.4 GiB (seed 1; seed 0 ran with `sampler.prompt_len=256`
and was killed by the kernel just after its update-20 checkpoint at 24 GB,
on a 24 GB machine: issue 56). Training on basic_arithmetic instead moved
it little (0.340 to 0.385 in 20 updates) while chain_sum, unseen, rose to
0.600. At temperature 1 the same model's sampled answers score a quarter
of its greedy ones (`benchmarks/reasoning_gym_survey.py --temperature`), and
a first run at 1 learned nothing in 10 updates.

Without a folder, the model is a ~0.8M-parameter byte-level decoder with a
supervised warm-up on the reference answers: it shows the data path and the
scorer end to end on 2 CPU cores, not reasoning.
"""

import ml_collections

from arl_jax.config import base_config
from arl_jax.envs import reasoning_gym_env


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  tasks_arg, _, variant = (arg or "").partition(":")
  tasks = [t.strip() for t in tasks_arg.split(",") if t.strip()]
  if not tasks:
    raise ValueError("configs/reasoning_gym.py needs the task names as its argument: "
                     "--config=configs/reasoning_gym.py:chain_sum[,gcd...][:FOLDER|:tiny]")
  config = base_config.make("reasoning_gym")
  # Each task at reasoning-gym's own defaults, so `--config.env.tasks.T.KEY=` reaches its keys
  # (a mistyped task is refused by the environment's config, with the list).
  known = reasoning_gym_env.task_names()
  config.env.tasks = {t: {"weight": 1.0, **(reasoning_gym_env.task_options(t) if t in known
                                             else {})} for t in tasks}
  config.update(num_steps=300, log_every=25, eval_every=100, eval_size=200)
  config.orchestrator.update(batch_size=32, group_size=8, mask_truncated_completions=True)
  if variant and variant != "tiny":
    base_config.use_hf_chat_model(config, variant)
    config.update(num_steps=40, log_every=5, eval_every=10)
    config.model.max_seq_len = 384
    config.sampler.update(num_slots=64, prompt_len=256, max_new_tokens=128)
    config.orchestrator.max_off_policy_steps = 4
    config.learner.update(eps_high=0.28, tis_cap=2.0, num_microbatches=2, lr=1e-5)
    config.checkpoint.update(every_steps=10, keep=2)
    config.warmup.update(steps=0, lr=1e-5)
  else:
    config.model.update(d_model=128, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32,
                        mlp_dim=384, max_seq_len=320, rope_theta=10_000.0, tie_embeddings=True)
    config.sampler.update(num_slots=64, prompt_len=288, max_new_tokens=32)
    config.warmup.steps = 300
    if variant == "tiny":
      base_config.make_tiny(config, num_steps=3)
      config.env.update(size=64, heldout_size=8)
  config.lock()
  return config
