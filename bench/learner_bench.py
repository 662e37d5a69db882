"""Learner speed: milliseconds per `Agent.train` update, FLOPs per update,
and the fraction of this device's measured matmul peak.

  .venv/bin/python bench/learner_bench.py --sizes size1m size12m \
      --dtypes float32 bfloat16 --out bench/learner_cpu.json

The agent is the `dmc_proprio` preset on dm_control walker's spaces
(24 observation dims, 6 continuous actions), batch 16 x 64 plus one
context step, as upstream trains it. Rounds alternate between the
configurations so a change in machine load hits them all alike.

FLOPs: matrix-product FLOPs (2 per multiply-add of every `dot_general`
and convolution) counted on the update's jaxpr, each scan body times its
length. XLA's `cost_analysis()` counts a scan body once, so its number
(reported as `xla_flops_scan_once`) undercounts the update by the
sequence and imagination lengths. The peak is n x n `jnp.dot`s of random
operands in the same dtype, back to back, timed in the same run: n = 2048
on a CPU, 8192 on an accelerator (whose 2048 x 2048 products reach only
about a third of what larger ones do).

Matmul floor: every matrix product of the update timed alone (at its own
shapes, dtypes and dimension numbers, on random operands, see
`product_seconds`), times how often the update runs it: an estimate (not
a strict bound; bench/README.md says why) of what an update would take if
all its other work were free. `x_floor` is ms per update / floor, and
`fraction_of_peak_at_floor` the fraction of the peak that
this model's products reach at their shapes.

`--upstream PYTHON SRC` times upstream DreamerV3's `train` at the same
configuration in the same rounds (`upstream_learner.py`, run by PYTHON, a
venv with upstream's dependencies, on SRC, a checkout of
danijar/dreamerv3) and reports ours / upstream in updates per second.
"""

import argparse
import json
import math
import os
import platform
import subprocess
import time
from pathlib import Path

import elements
import jax
import jax.numpy as jnp
import numpy as np

from dreamer_ver import config as configlib
from dreamer_ver.agent.agent import Agent

OBS = {'orientations': (14,), 'height': (), 'velocity': (9,)}
ACT = (6,)


def spaces():
  obs = {k: elements.Space(np.float32, s) for k, s in OBS.items()}
  obs.update({'reward': elements.Space(np.float32, ()),
              'is_first': elements.Space(bool, ()),
              'is_last': elements.Space(bool, ()),
              'is_terminal': elements.Space(bool, ())})
  act = {'action': elements.Space(np.float32, ACT, -1, 1),
         'reset': elements.Space(bool, ())}
  return obs, act


def random_batch(agent, B, T, seed):
  rng = np.random.default_rng(seed)
  r = agent.config.agent.rssm
  batch = {k: rng.uniform(-1, 1, (B, T, *s.shape)).astype(np.float32)
           for k, s in {**agent.obs_space, **agent.act_space}.items()
           if s.dtype == np.float32}
  for key in ('is_first', 'is_last', 'is_terminal'):
    batch[key] = np.zeros((B, T), bool)
  batch['is_first'][:, 0] = True
  batch['dyn/deter'] = np.zeros((B, T, r.deter), np.float32)
  batch['dyn/stoch'] = np.zeros((B, T, r.stoch, r.classes), np.float32)
  batch['stepid'] = np.zeros((B, T, 20), np.uint8)
  batch['consec'] = np.zeros((B, T), np.int32)
  return batch


def matmul_ops(jaxpr):
  """The matrix products (`dot_general`s and convolutions) of a jaxpr as
  {signature: [equation, count]}, each scan body counted times its length
  (of a cond's branches, the costliest)."""
  ops = {}
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ('dot_general', 'conv_general_dilated'):
      signature = (eqn.primitive.name, repr(sorted(eqn.params.items())),
                   tuple((v.aval.shape, str(v.aval.dtype)) for v in eqn.invars))
      ops.setdefault(signature, [eqn, 0])[1] += 1
    for value in eqn.params.values():
      for sig, (sub, count) in _ops_of(value).items():
        ops.setdefault(sig, [sub, 0])[1] += count * eqn.params.get('length', 1)
  return ops


def _ops_of(value):
  """The products of a param that holds jaxprs (one, or branches)."""
  if isinstance(value, (tuple, list)):
    return max((_ops_of(v) for v in value), key=total_flops, default={})
  inner = getattr(value, 'jaxpr', value)  # ClosedJaxpr -> Jaxpr
  return matmul_ops(inner) if hasattr(inner, 'eqns') else {}


def flops(eqn):
  """2 per multiply-add of one matrix product."""
  out = eqn.outvars[0].aval.shape
  if eqn.primitive.name == 'dot_general':
    (contract, _), _ = eqn.params['dimension_numbers']
    lhs = eqn.invars[0].aval.shape
    return 2 * math.prod(out) * math.prod(lhs[d] for d in contract)
  rhs = eqn.invars[1].aval.shape
  spec = eqn.params['dimension_numbers'].rhs_spec  # (out, in, *spatial)
  return 2 * math.prod(out) * math.prod(rhs[d] for d in spec[1:])


def total_flops(ops):
  return sum(count * flops(eqn) for eqn, count in ops.values())


def product_seconds(eqn, copies=8, calls=3):
  """Seconds of one matrix product alone, at its shapes, dtypes and
  dimension numbers, on `copies` sets of random operands: the faster of
  one compiled scan over the copies (no dispatch per product, but the scan
  slices its inputs and stacks its outputs) and one jitted call per copy
  (no copies, but a dispatch each); best of `calls`."""
  rng = np.random.default_rng(0)
  operands = [jnp.asarray(rng.standard_normal((copies, *v.aval.shape))
                          .astype(v.aval.dtype)) for v in eqn.invars]
  one = jax.jit(lambda *xs: eqn.primitive.bind(*xs, **eqn.params))
  scan = jax.jit(lambda xs: jax.lax.scan(lambda _, x: (None, one(*x)),
                                         None, xs)[1])
  apart = [[x[i] for x in operands] for i in range(copies)]
  ways = [lambda: scan(operands), lambda: [one(*xs) for xs in apart]]
  best = math.inf
  for way in ways:
    jax.block_until_ready(way())
    for _ in range(calls):
      start = time.perf_counter()
      jax.block_until_ready(way())
      best = min(best, time.perf_counter() - start)
  return best / copies


def matmul_floor(ops):
  """Seconds the update's matrix products take, each timed alone: what an
  update would take if everything else it does were free."""
  return sum(count * product_seconds(eqn) for eqn, count in ops.values())


def make(size, dtype, batch, length):
  config = configlib.compose(['dmc_proprio', size], {
      'jax.compute_dtype': dtype, 'batch_size': batch,
      'batch_length': length})
  agent = Agent(*spaces(), config)
  T = length + config.replay_context
  state = agent.init_state(agent.init_params(0), 0)
  carry = agent.init_carry(batch)
  batches = [jax.device_put(random_batch(agent, batch, T, s)) for s in range(2)]
  jaxpr = jax.make_jaxpr(agent._train)(state, carry, batches[0])
  ops = matmul_ops(jaxpr.jaxpr)
  compiled = agent.train.lower(state, carry, batches[0]).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  state, carry, _, mets = agent.train(state, carry, batches[0])  # warm-up
  jax.block_until_ready(mets)
  return {'agent': agent, 'state': state, 'carry': carry, 'batches': batches,
          'ops': ops, 'flops': total_flops(ops),
          'xla_flops_scan_once': float(cost.get('flops', 0)),
          'params': Agent.param_count(state['params'])}


def time_updates(run, steps):
  """Seconds per update over `steps` updates (the state threads through)."""
  agent, state, carry = run['agent'], run['state'], run['carry']
  start = time.perf_counter()
  for i in range(steps):
    state, carry, _, mets = agent.train(
        state, carry, run['batches'][i % len(run['batches'])])
  jax.block_until_ready(mets)
  run['state'], run['carry'] = state, carry
  return (time.perf_counter() - start) / steps


def matmul_peak(dtype, n, repeats=20):
  """Sustained FLOP/s of back-to-back n x n matrix products in `dtype`."""
  x = jax.random.normal(jax.random.PRNGKey(0), (n, n), dtype)
  dot = jax.jit(jnp.dot)
  dot(x, x).block_until_ready()
  start = time.perf_counter()
  for _ in range(repeats):
    y = dot(x, x)
  y.block_until_ready()
  return repeats * 2 * n ** 3 / (time.perf_counter() - start)


class Upstream:
  """upstream_learner.py in its own venv, compiled and waiting for rounds."""

  def __init__(self, python, src, size, dtype, batch, length, steps):
    script = Path(__file__).with_name('upstream_learner.py')
    backend = 'cpu' if jax.default_backend() == 'cpu' else 'cuda'
    self.proc = subprocess.Popen(
        [python, str(script), src, size, dtype, str(batch), str(length),
         str(steps), backend], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL if backend == 'cpu' else None, text=True,
        env={**os.environ, 'JAX_PLATFORMS': backend})
    self._read()  # {'ready': true} once compiled

  def time_round(self):
    self.proc.stdin.write('go\n')
    self.proc.stdin.flush()
    return self._read()['seconds']

  def _read(self):
    for line in self.proc.stdout:  # upstream prints its own lines too
      if line.startswith('{'):
        return json.loads(line)
    raise RuntimeError(f'upstream_learner.py exited with {self.proc.wait()}')

  def close(self):
    self.proc.stdin.close()
    self.proc.wait()


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--sizes', nargs='+', default=['size1m', 'size12m'])
  parser.add_argument('--dtypes', nargs='+', default=['float32', 'bfloat16'])
  parser.add_argument('--batch', type=int, default=16)
  parser.add_argument('--length', type=int, default=64)
  parser.add_argument('--steps', type=int, default=5)
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--upstream', nargs=2, metavar=('PYTHON', 'SRC'))
  parser.add_argument('--floor', action=argparse.BooleanOptionalAction,
                      default=True, help='time the matmul floor (one '
                      'compile per product: minutes on a GPU)')
  parser.add_argument('--out', default='')
  args = parser.parse_args()
  runs = {}
  for size in args.sizes:
    for dtype in args.dtypes:
      began = time.perf_counter()
      runs[size, dtype] = make(size, dtype, args.batch, args.length)
      print(f'{size} {dtype}: compiled in {time.perf_counter() - began:.0f} s',
            flush=True)
  upstream = {}
  for key in runs if args.upstream else ():
    try:
      upstream[key] = Upstream(*args.upstream, *key, args.batch, args.length,
                               args.steps)
    except RuntimeError as e:  # ours is still measured
      print(f'upstream {key}: {e}', flush=True)
  peak_n = 2048 if jax.default_backend() == 'cpu' else 8192
  peaks = {d: matmul_peak(d, peak_n) for d in args.dtypes}
  floors = {key: matmul_floor(run['ops']) if args.floor else math.nan
            for key, run in runs.items()}
  times = {key: [] for key in runs}
  theirs = {key: [] for key in upstream}
  for _ in range(args.rounds):
    for key, run in runs.items():
      times[key].append(time_updates(run, args.steps))
      if key in upstream:
        theirs[key].append(upstream[key].time_round())
  for proc in upstream.values():
    proc.close()
  rows = []
  for (size, dtype), run in runs.items():
    seconds = float(np.median(times[(size, dtype)]))
    rows.append({
        'size': size, 'dtype': dtype, 'params': run['params'],
        'ms_per_update': [round(t * 1e3, 1) for t in times[(size, dtype)]],
        'updates_per_s': round(1 / seconds, 3),
        'gflop_per_update': round(run['flops'] / 1e9, 2),
        'xla_gflop_scan_once': round(run['xla_flops_scan_once'] / 1e9, 2),
        'gflop_per_s': round(run['flops'] / seconds / 1e9, 1),
        'fraction_of_matmul_peak': round(run['flops'] / seconds / peaks[dtype], 3),
        'matmul_floor_ms': round(floors[(size, dtype)] * 1e3, 1),
        'x_floor': round(seconds / floors[(size, dtype)], 2),
        'fraction_of_peak_at_floor': round(
            run['flops'] / floors[(size, dtype)] / peaks[dtype], 3),
    })
    if theirs:
      upstream_seconds = float(np.median(theirs[(size, dtype)]))
      rows[-1]['upstream_ms_per_update'] = [
          round(t * 1e3, 1) for t in theirs[(size, dtype)]]
      rows[-1]['speedup_vs_upstream'] = round(upstream_seconds / seconds, 2)
    print(json.dumps(rows[-1]), flush=True)
  commit = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'],
                          capture_output=True, text=True).stdout.strip()
  result = {
      'commit': commit, 'device': str(jax.devices()[0].device_kind),
      'machine': platform.processor() or platform.machine(),
      'batch': [args.batch, args.length],
      'matmul_peak_n': peak_n,
      'matmul_peak_gflop_per_s': {d: round(p / 1e9, 1) for d, p in peaks.items()},
      'rows': rows}
  print(json.dumps(result['matmul_peak_gflop_per_s']))
  if args.out:
    with open(args.out, 'w') as f:
      json.dump(result, f, indent=1)


if __name__ == '__main__':
  main()
