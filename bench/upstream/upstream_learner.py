"""Upstream DreamerV3's `train` at the learner bench's configuration, run by
`learner_bench.py --upstream SRC` on the same interpreter and JAX as ours,
in the environment `upstream.environ` makes (the jit shim, upstream-only
packages and SRC on PYTHONPATH).

  python -m bench.upstream.upstream_learner SRC SIZE DTYPE BATCH LENGTH STEPS PLATFORM

Builds upstream's agent (SRC: a checkout of danijar/dreamerv3) with the
`dmc_proprio` preset and SIZE on the same walker spaces, compiles its train
step, then times STEPS updates for each line `go` it reads on stdin and
prints the seconds per update as one JSON line. The policy copy upstream
makes after an update is off (`jax.enable_policy False`): both sides time
training alone. Its host allocator is the environment's it starts with
(`learner_bench.py --upstream_malloc`).
"""

import json
import pathlib
import sys
import tempfile
import time

import numpy as np

OBS = {'orientations': (14,), 'height': (), 'velocity': (9,)}
ACT = (6,)


def build(src, size, dtype, batch, length, platform):
  import elements
  import ruamel.yaml as yaml
  from dreamerv3.agent import Agent
  configs = yaml.YAML(typ='safe').load(
      (pathlib.Path(src) / 'dreamerv3' / 'configs.yaml').read_text())
  config = elements.Config(configs['defaults'])
  for name in ('dmc_proprio', size):
    config = config.update(configs[name])
  config = config.update({
      'jax.platform': platform, 'jax.compute_dtype': dtype,
      'jax.prealloc': False, 'jax.enable_policy': False, 'batch_size': batch,
      'batch_length': length, 'logdir': tempfile.mkdtemp()})
  obs = {k: elements.Space(np.float32, s) for k, s in OBS.items()}
  obs.update({'reward': elements.Space(np.float32),
              'is_first': elements.Space(bool),
              'is_last': elements.Space(bool),
              'is_terminal': elements.Space(bool)})
  act = {'action': elements.Space(np.float32, ACT, -1, 1)}
  return Agent(obs, act, elements.Config(
      **config.agent, logdir=config.logdir, seed=config.seed,
      jax={**config.jax, 'profiler': False}, batch_size=batch, batch_length=length,
      replay_context=config.replay_context,
      report_length=config.report_length, replica=0, replicas=1))


def random_data(agent, batch, T, seed):
  rng = np.random.default_rng(seed)
  data = {}
  for key, space in agent.spaces.items():
    shape = (batch, T, *space.shape)
    if space.dtype == bool:
      data[key] = np.zeros(shape, bool)
    elif np.issubdtype(space.dtype, np.floating):
      data[key] = rng.uniform(-1, 1, shape).astype(space.dtype)
    else:
      data[key] = np.zeros(shape, space.dtype)
  data['is_first'][:, 0] = True
  return data


def main():
  src, size, dtype = sys.argv[1:4]
  batch, length, steps = map(int, sys.argv[4:7])
  agent = build(src, size, dtype, batch, length, sys.argv[7])
  from embodied.jax import internal
  T = length + agent.config.replay_context
  datas = [random_data(agent, batch, T, s) for s in range(2)]
  carry = agent.init_train(batch)
  counter = [0]

  def update(carry):
    data = internal.device_put(
        datas[counter[0] % 2], agent.train_sharded)
    data['seed'] = agent._seeds(counter[0], agent.train_mirrored)
    counter[0] += 1
    return agent.train(carry, data)[0]

  carry = update(update(carry))  # compile, and fetch a step's outputs
  import jax
  jax.block_until_ready(carry)
  print(json.dumps({'ready': True}), flush=True)
  for line in sys.stdin:
    if line.strip() != 'go':
      break
    start = time.perf_counter()
    for _ in range(steps):
      carry = update(carry)
    jax.block_until_ready((carry, agent.params))
    print(json.dumps({'seconds': (time.perf_counter() - start) / steps}),
          flush=True)


if __name__ == '__main__':
  main()
