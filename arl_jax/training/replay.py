"""`run(config, workdir)` with `replay.from_run`: a recorded run, again.

A recorded run that stopped and resumed has a schedule of several segments
(`core/schedule.py`), one per start; the state each resume started from is
a checkpoint's, whose open segments were read at a recorded engine
iteration. A replay goes through the same points: it follows a segment until
the recorded run stopped (a final save) or was last saved before it
resumed, stops there as the recorded run did, and resumes from its own
checkpoint of that version, following the next segment, until the last.
"""

from __future__ import annotations

from arl_jax.core import schedule as schedule_lib
from arl_jax.training import run_lib


def run(config, workdir: str, **kwargs) -> run_lib.RunResult:
  """Runs `config` (with `replay.from_run` set) through every segment of the
  recorded schedule; `kwargs` go to `run_lib.run`. Returns the last
  segment's result.

  Raises:
    schedule.ReplayDiverged: the replay differs from the recording (the
      first update whose inputs or params differ, and what differed).
    schedule.ScheduleError: the schedule cannot be read or followed.
  """
  version = None
  while True:
    try:
      result = run_lib.run(config, workdir, **kwargs)
    except RuntimeError as e:  # (the sampler engine's thread found it: its failure's cause)
      if isinstance(e.__cause__, schedule_lib.ReplayDiverged):
        raise e.__cause__ from None
      raise
    if result.complete or result.stop_reason != schedule_lib.REPLAY_STOP:
      return result
    if result.final_version == version:  # (a resume that moved no further)
      raise schedule_lib.ScheduleError(
          f"replay: no progress past version {version} following {config.replay.from_run}")
    version = result.final_version
