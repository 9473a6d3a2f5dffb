"""A loss is one file: a module in `learner/objectives/` with its formula, its
knobs and `ENTRIES`. Shown end to end in a fresh process whose objectives
package has one more folder holding only such a file: the config accepts the
loss and its knob, and a run trains with it."""

import json
import subprocess
import sys
import textwrap

from arl_jax.learner import loss_registry, loss_settings
from arl_jax.testing import xla_env

SIGN_PG = textwrap.dedent('''
    """A test loss: the policy gradient of the advantage's sign, scaled."""
    import dataclasses

    import jax.numpy as jnp

    from arl_jax.core import settings
    from arl_jax.learner import loss_entry
    from arl_jax.learner import losses as losses_lib


    @dataclasses.dataclass(frozen=True, kw_only=True)
    class SignPg:
      """Attributes:
        sign_scale: the step's size.
      """

      sign_scale: float = 1.0

      def __post_init__(self):
        settings.check(self.sign_scale > 0, "sign_scale", f"must be > 0, got {self.sign_scale}")


    def sign_pg(logprobs, behaviour_logprobs, advantages, loss_mask, *, proximal_logprobs=None,
                token_lag=None, segment_ids=None, scale=1.0):
      del behaviour_logprobs, proximal_logprobs, token_lag, segment_ids
      loss = -scale * jnp.sign(advantages) * logprobs
      return jnp.where(loss_mask > 0, loss, 0.0), {"sign_scale": jnp.asarray(scale)}


    ENTRIES = {"sign_pg": loss_entry.LossEntry(
        fn=sign_pg, knobs=SignPg, kwargs=lambda k, c: dict(scale=k.sign_scale),
        corrections=False, age_decay=False)}
''')

CHILD = textwrap.dedent('''
    import json, sys
    import arl_jax.learner.objectives as objectives
    objectives.__path__.append(sys.argv[1])
    from arl_jax.learner import loss_registry
    from arl_jax.config import run_spec
    from arl_jax.testing import tiny
    from arl_jax.training import run_lib
    config = tiny.load_config("arith", "tiny")
    config.learner.loss = "sign_pg"
    config.learner.sign_scale = 0.5  # (a key the base config got from the new file)
    config.update(num_steps=1, eval_every=0)
    spec = run_spec.build(config)
    config.learner.sign_scale = -1.0
    try:
      run_spec.build(config)
      refused = None
    except run_spec.ConfigError as e:
      refused = str(e)
    config.learner.sign_scale = 0.5
    result = run_lib.run(config, sys.argv[2], print_fn=lambda *_: None)
    print(json.dumps({"knob": spec.loss.loss_knobs(), "refused": refused,
                      "trained": result.final_version,
                      "logged": result.history[-1].get("sign_scale")}))
''')


def test_a_new_loss_is_one_file(tmp_path):
  folder = tmp_path / "more_objectives"
  folder.mkdir()
  (folder / "sign_pg.py").write_text(SIGN_PG)
  proc = subprocess.run([sys.executable, "-c", CHILD, str(folder), str(tmp_path / "run")],
                        capture_output=True, text=True, env=xla_env.subprocess_env(),
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(proc.stdout.strip().splitlines()[-1])
  assert report["knob"] == {"scale": 0.5}
  assert "config.learner.sign_scale: must be > 0, got -1.0" in report["refused"]
  assert report["trained"] == 1 and report["logged"] == 0.5


def test_every_built_in_loss_is_registered_with_its_knobs():
  assert sorted(loss_registry.LOSSES) == ["cispo", "clipped_ratio", "gspo", "gspo_token", "m2po",
                                          "vtrace"]
  assert [k.__name__ for k in loss_registry.KNOBS] == ["Cispo", "ClippedRatio", "Gspo", "M2po",
                                                       "Vtrace"]
  settings = loss_settings.LossSettings.of(loss="gspo_token", gspo_eps_high=0.01)
  assert settings.loss_knobs()["eps_high"] == 0.01 and settings.entry.fn.__name__ == "gspo_token"
