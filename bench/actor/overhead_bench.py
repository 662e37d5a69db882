"""Per-batch host overhead of the actor, per padded bucket.

For each bucket size, times the actor's whole step (admit the rows into
the padded batch with their carry slots, run the jitted
gather/policy/scatter, copy actions out) next to the bare jitted
step on inputs already on the device. The difference is the host's share;
it should grow with the batch only as much as the observation copy does.

  .venv/bin/python -m bench.actor.overhead_bench --sizes size1m size12m --out FILE

`--image` measures a vision policy on 64x64 frames instead.

`--stages` splits `Actor.handle` (what the batch server calls per batch)
into its stages by timing the real functions it calls, wrapped in place:

  admit     checking the requests, copying them into the padded batch,
            giving out their carry slots (`BatchedPolicy.admit`)
  dispatch  the jitted step's call until it returns (flattening the params
            tree, copying the host arrays in, enqueueing)
  device    from there until its outputs are ready
  fetch     copying the outputs to the host (`batched_policy.fetch`)
  rest      everything else in handle: the params lookup, the
            transition dict, one reply per env, the `log/` keys

next to the same handle with a null policy (a jitted step that returns
zeros of the real outputs' shapes): the host path's floor.
"""

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench import stamp
from bench.actor import actor_bench  # the same actor the throughput bench uses


def measure(actor, repeats):
  """Median ms per bucket of actor.step and of the bare jitted step."""
  rows = []
  lane = actor.lanes[0]
  params, _ = actor.params.latest(0)
  for size in actor.buckets:
    datas = actor_bench.zero_requests(actor, size)
    step = []
    for _ in range(repeats):
      start = time.perf_counter()
      actor.step(datas)
      step.append(time.perf_counter() - start)
    obs = jax.device_put({k: np.stack([d[k] for d in datas])
                          for k in actor.obs_space})
    slots = jax.device_put(np.arange(size, dtype=np.int32))
    forward = []
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(
          actor.forward(lane, params, slots, obs))
      forward.append(time.perf_counter() - start)
    obs_bytes = sum(v.nbytes for v in jax.tree.leaves(obs))
    step_ms, forward_ms = 1000 * np.median(step), 1000 * np.median(forward)
    rows.append(dict(bucket=size, step_ms=float(step_ms),
                     forward_ms=float(forward_ms),
                     host_ms=float(step_ms - forward_ms), obs_bytes=obs_bytes))
  return rows


STAGES = ('admit', 'dispatch', 'device', 'fetch', 'rest')


def measure_stages(actor, repeats):
  """Median microseconds per stage of Actor.handle per bucket (see the
  module docstring), with the real policy and with the null one."""
  from dreamer_ver.actor import batched_policy
  from dreamer_ver.rpc.batch_requests import Request
  policy = actor.policy
  spent = {}

  def timed(name, fn, block=False):
    def wrapped(*args, **kwargs):
      start = time.perf_counter()
      result = fn(*args, **kwargs)
      spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
      if block:
        start = time.perf_counter()
        jax.block_until_ready(result)
        spent['device'] = time.perf_counter() - start
      return result
    return wrapped

  originals = (policy.admit, batched_policy.fetch, policy.forward,
               policy._step)
  real_step = policy._step
  null_step = _null_step(policy)
  rows = []
  try:
    policy.admit = timed('admit', policy.admit)
    batched_policy.fetch = timed('fetch', batched_policy.fetch)
    policy.forward = timed('dispatch', policy.forward, block=True)
    for label, step in (('policy', real_step), ('null', null_step)):
      policy._step = step
      for size in actor.buckets:
        requests = [Request(conn=i, reqnum=0, data=data, arrival=0.0,
                            envid=i)
                    for i, data in enumerate(
                        actor_bench.zero_requests(actor, size))]
        samples = {name: [] for name in (*STAGES, 'handle')}
        for index in range(repeats + 2):  # Two warm-up calls.
          spent.clear()
          start = time.perf_counter()
          actor.handle(requests)
          total = time.perf_counter() - start
          if index < 2:
            continue
          samples['handle'].append(total)
          for name in STAGES[:-1]:
            samples[name].append(spent.get(name, 0.0))
          samples['rest'].append(total - sum(spent.values()))
        rows.append(dict(policy=label, bucket=size, **{
            f'{name}_us': float(1e6 * np.median(values))
            for name, values in samples.items()}))
  finally:
    (policy.admit, batched_policy.fetch, policy.forward,
     policy._step) = originals
  return rows


def _null_step(policy):
  """A jitted step of the real one's signature that returns the carry
  table as it is and zeros shaped like the real outputs."""
  spec = policy.out_spec

  def step(table, slots, params, obs, key, number):
    del params, obs, key, number
    return table, {k: jnp.zeros((slots.shape[0], *shape), dtype)
                   for k, (shape, dtype) in spec.items() if k != 'version'}
  null = jax.jit(step, donate_argnums=(0,))
  for lane in policy.lanes:  # Compiled before any timing.
    for size in policy.buckets:
      obs = {k: np.zeros((size, *s.shape), s.dtype)
             for k, s in policy.spec.items()}
      slots = np.full((size,), lane.padding, np.int32)
      leaves = policy._leaves(lane, policy._params(lane)[0])
      lane.table, out = null(lane.table, slots, leaves, obs, policy.key,
                             np.uint32(0))
      jax.block_until_ready(out)
  return null


def stages_table(rows):
  lines = ['| policy | bucket | handle us | ' + ' | '.join(STAGES) + ' |',
           '| --- | ---: |' + ' ---: |' * (len(STAGES) + 1)]
  for r in rows:
    lines.append(f"| {r['policy']} | {r['bucket']} | {r['handle_us']:.0f} | "
                 + ' | '.join(f"{r[f'{n}_us']:.0f}" for n in STAGES) + ' |')
  return '\n'.join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--sizes', nargs='+', default=['size1m'])
  parser.add_argument('--task', default='dmc_cartpole_balance',
                      help='env whose observation space the policy gets')
  parser.add_argument('--envs', type=int, default=64,
                      help='largest bucket (powers of two up to it)')
  parser.add_argument('--repeats', type=int, default=50)
  parser.add_argument('--image', action='store_true',
                      help='dmc: 64x64 image observations (a CNN policy) '
                      'instead of proprioception only')
  parser.add_argument('--stages', action='store_true',
                      help='split Actor.handle into its stages, with the '
                      'real and a null policy (see above)')
  parser.add_argument('--out', default=None, help='write the rows as JSON')
  args = parser.parse_args(argv)
  from dreamer_ver.config import loading as configlib
  records = []
  device = jax.devices()[0]
  print(f'device: {device.device_kind} ({device.platform})', flush=True)
  for size in args.sizes:
    config = configlib.compose([size], {
        'task': args.task, 'run.envs': args.envs, 'run.eval_envs': 0,
        'env.dmc.image': args.image, 'env.dmc.proprio': not args.image})
    # `log_image` (a video frame for the logger) has no config key.
    actor, _ = actor_bench.make_actor(config, {'dmc': {'log_image': False}})
    rows = (measure_stages if args.stages else measure)(actor, args.repeats)
    for row in rows:
      records.append({'size': size, 'device': device.device_kind, **row})
  if args.stages:
    for size in args.sizes:
      print(f'{size}:')
      print(stages_table([r for r in records if r['size'] == size]))
    return _write(records, args.out)
  print('| size | bucket | actor.step ms | jitted step ms | host ms | obs KB |')
  print('| --- | ---: | ---: | ---: | ---: | ---: |')
  for r in records:
    print(f"| {r['size']} | {r['bucket']} | {r['step_ms']:.3f} | "
          f"{r['forward_ms']:.3f} | {r['host_ms']:.3f} | "
          f"{r['obs_bytes'] / 1024:.1f} |")
  return _write(records, args.out)


def _write(records, path):
  if path:
    stamp.write(path, records)
    print(f'Wrote {path}.')
  return 0


if __name__ == '__main__':
  sys.exit(main())
