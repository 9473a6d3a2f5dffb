"""Weights pulled by a sampler in another process equal what the learner published."""

import os
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from arl_jax.distributed import weight_transfer
from arl_jax.learner import publish as publish_lib
from arl_jax.models import lora
from arl_jax.testing import tiny, xla_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The sampler process: 4 devices of its own, the sampler's shardings on them;
# it saves each version it pulls, until version 2.
_SAMPLER = r"""
import os, sys, time
os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=4"
import jax, numpy as np
from jax.sharding import Mesh
from arl_jax.distributed import weight_transfer
from arl_jax.models import init_lib, lora
from arl_jax.sharding import rules as rules_lib
from arl_jax.testing import tiny
address, out, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
mesh = Mesh(np.array(jax.devices()).reshape(4, 1), ("data", "tp"))
_, abstract = init_lib.abstract_model(tiny.tiny_model_config(lora=lora.LoraConfig(rank=rank)))
shardings = rules_lib.state_shardings(abstract, mesh, rules_lib.SAMPLER_RULES)
abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract, shardings)
client = weight_transfer.WeightClient(address, abstract, poll_interval_s=0.0)
saved = set()
while 2 not in saved:
  version, params = client.latest()
  if version is not None and version not in saved:
    assert all(x.sharding.mesh.devices.size == 4 for x in jax.tree.leaves(params))
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    np.savez(os.path.join(out, f"v{version}.npz"),
             **{jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves})
    saved.add(version)
  time.sleep(0.02)
print("pulls", client.pulls, "bytes", client.pulled_bytes)
"""


def _wait_for(path, proc, timeout=120.0):
  deadline = time.monotonic() + timeout
  while not os.path.exists(path):
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    assert time.monotonic() < deadline, f"{path} never appeared"
    time.sleep(0.05)
  time.sleep(0.2)  # np.savez finished writing


def _host(params) -> dict:
  return {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


@pytest.mark.parametrize("rank", [0, 4])
def test_a_sampler_process_pulls_each_published_version_exactly(tmp_path, rank):
  """Rank 0: every pull is the whole model. LoRA: the first pull brings the
  base with the adapters, every later one the adapters alone."""
  meshes = tiny.role_meshes()
  cfg = tiny.tiny_model_config(lora=lora.LoraConfig(rank=rank))
  _, params, sampler_shardings = tiny.learner_and_sampler_params(cfg, meshes)
  trainable, frozen = lora.split(params)
  versions = [trainable, tiny.perturb(trainable, 0.05, seed=3)]
  publisher = publish_lib.WeightPublisher(meshes.learner, sampler_shardings,
                                          frozen=frozen if rank else None)
  server = weight_transfer.WeightServer(publisher)
  env = xla_env.subprocess_env()
  proc = subprocess.Popen([sys.executable, "-c", _SAMPLER, server.address, str(tmp_path),
                           str(rank)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  served = []
  try:
    for version, params in ((1, versions[0]), (2, versions[1])):
      publisher.publish(params, version)
      want = _host(publisher.latest()[1])
      _wait_for(tmp_path / f"v{version}.npz", proc)
      got = np.load(tmp_path / f"v{version}.npz")
      assert set(got.files) == set(want)
      for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
      served.append(server.bytes_served - sum(served))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert f"pulls 2 bytes {sum(served)}" in out
    assert server.pulls_served == 2
    whole = 4 * (cfg.num_params + cfg.adapter_params)
    assert served == ([whole, whole] if not rank else [whole, 4 * cfg.adapter_params])
  finally:
    if proc.poll() is None:
      proc.kill()
    server.close()
