"""Per-batch host overhead of the actor, per padded bucket.

For each bucket size, times the actor's whole step as the batch server calls
it (stack the observations on the host, look up the carry slots, run the
jitted gather/policy/scatter, copy actions out) next to the bare jitted
step on inputs already on the device. The difference is the host's share;
it should grow with the batch only as much as the observation copy does.

  .venv/bin/python bench/overhead_bench.py --sizes size1m size12m --out FILE

`--image` measures a vision policy on 64x64 frames instead.
"""

import argparse
import json
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import actor_bench  # noqa: E402  (the same actor the throughput bench uses)


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
          actor.forward(lane, params, slots, obs, actor.key))
      forward.append(time.perf_counter() - start)
    obs_bytes = sum(v.nbytes for v in jax.tree.leaves(obs))
    step_ms, forward_ms = 1000 * np.median(step), 1000 * np.median(forward)
    rows.append(dict(bucket=size, step_ms=float(step_ms),
                     forward_ms=float(forward_ms),
                     host_ms=float(step_ms - forward_ms), obs_bytes=obs_bytes))
  return rows


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
  parser.add_argument('--out', default=None, help='write the rows as JSON')
  args = parser.parse_args(argv)
  from dreamer_ver import config as configlib
  records = []
  device = jax.devices()[0]
  print(f'device: {device.device_kind} ({device.platform})', flush=True)
  for size in args.sizes:
    config = configlib.compose([size], {
        'task': args.task, 'run.envs': args.envs, 'run.eval_envs': 0,
        'env.dmc.image': args.image, 'env.dmc.proprio': not args.image})
    # `log_image` (a video frame for the logger) has no config key.
    actor, _ = actor_bench.make_actor(config, {'dmc': {'log_image': False}})
    for row in measure(actor, args.repeats):
      records.append({'size': size, 'device': device.device_kind, **row})
  print('| size | bucket | actor.step ms | jitted step ms | host ms | obs KB |')
  print('| --- | ---: | ---: | ---: | ---: | ---: |')
  for r in records:
    print(f"| {r['size']} | {r['bucket']} | {r['step_ms']:.3f} | "
          f"{r['forward_ms']:.3f} | {r['host_ms']:.3f} | "
          f"{r['obs_bytes'] / 1024:.1f} |")
  if args.out:
    with open(args.out, 'w') as f:
      json.dump(records, f, indent=1)
    print(f'Wrote {args.out}.')
  return 0


if __name__ == '__main__':
  sys.exit(main())
