"""A multi-controller process other than 0 (a follower).

It executes what process 0 decides, step by step (`lockstep.Step`): train on
the batch process 0 cut, in the same SPMD program, publish, then evaluate and
save a checkpoint when the step says so, until a `STOP` (which may ask for a
last evaluation and save). It decides nothing itself: a second copy of the
schedule could disagree with process 0's, and the collectives would deadlock.
Meanwhile it samples on its own devices for process 0's orchestrator, as a
member of its sampler fleet, with weights from its own share of each publish.
Its finished groups stay here (`held_groups.py`): process 0 hears their
metadata, and each step's plan says which rows this process fills with them
(`shard_batch.py`).
"""

from __future__ import annotations

import itertools

import jax

from arl_jax.distributed import (
  held_groups,
  learner_link,
  lockstep,
  sampler_worker,
  shard_batch,
  shard_plan,
)
from arl_jax.training import run_context


def follow(run: run_context.RunContext, learner: run_context.Learner) -> bool:
  """Runs a follower until process 0 stops the run, training `learner` in
  step (its `state` and `version` follow); returns whether process 0 found
  the run complete."""
  spec, meshes, checkpointer = run.spec, run.meshes, run.checkpointer
  complete = False
  link = learner_link.LearnerLink(lockstep.share_text(None, meshes.learner),
                                    name=f"process {jax.process_index()}",
                                    process=jax.process_index(),
                                    num_devices=meshes.sampler.devices.size)
  held = held_groups.HeldGroups()
  sampling = sampler_worker.LocalSampling(spec, mesh=meshes.sampler, graphdef=run.graphdef,
                                          weights=learner.publisher, link=link, held=held,
                                          process_index=jax.process_index())
  blocks_of_process = shard_plan.row_blocks(meshes.learner)
  here = held.rollout  # (group id, sample index) -> a rollout held here

  learner.publisher.publish(learner.state.params, learner.version)
  sampling.start()
  try:
    for index in itertools.count(learner.version):
      # Into the collective only once process 0 is (a collective waiting for
      # it would hold back this process's sampler, whose rollouts process 0
      # may be waiting for; lockstep.py).
      link.wait_for_lockstep(min(index, spec.run.num_steps))
      step = lockstep.share(None, meshes.learner)
      if step.kind == lockstep.BATCH:
        plan = step.plan
        batch, _ = shard_batch.local_batch(plan, here, meshes.learner, pad_id=run.pad_id,
                                           blocks_of_process=blocks_of_process)
        held.release(plan.group_ids)  # trained, here or elsewhere
        held.forget(plan.forget)  # never to train
        if checkpointer is not None and checkpointer.release(learner.state):
          run.memory.release_free()  # (a save read the state's buffers: learner_loop.py)
        learner.state, _ = learner.update_fn(learner.state, batch)
        learner.version += 1
        learner.publisher.publish(learner.state.params, learner.version)
      if step.evaluate:  # (the current params: the old ones were donated)
        run.eval_log(learner.params, learner.version, "rl")
      if step.save:
        # Process 0's open work gets the arrays of the groups held here;
        # every process writes its shards; orbax writes the run record from
        # process 0 only (this one's is a placeholder).
        shard_batch.collect_held(None, here, meshes.learner)
        checkpointer.save(learner.version, learner.state, {"version": learner.version},
                          learner.reference)
      if step.kind != lockstep.BATCH:
        complete = step.complete
        break
      if sampling.failed:
        # Fail fast, as a multi-controller job does: this process's groups
        # would never come back, and the job restarts from its checkpoint.
        raise RuntimeError(f"process {jax.process_index()}'s sampler failed: "
                           f"{sampling.describe_failure()}")
  finally:
    if checkpointer is not None:
      checkpointer.close()
    sampling.stop(say_bye=False)
  return complete
