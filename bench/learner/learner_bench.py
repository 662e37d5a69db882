"""Learner speed: milliseconds per `Agent.train` update, FLOPs per update,
and the fraction of this device's measured matmul peak.

  .venv/bin/python -m bench.learner.learner_bench --sizes size1m size12m \
      --dtypes float32 bfloat16 --out bench/results/learner_cpu.json

The agent is the `dmc_proprio` preset on dm_control walker's spaces
(24 observation dims, 6 continuous actions), batch 16 x 64 plus one
context step, as upstream trains it; `--task` takes a task's own spaces
instead (its env is made once, as the runtime does), so that the learner
alone is timed at a whole run's configuration (bench/system/e2e.py
`--learner_alone`). Rounds alternate between the
configurations so a change in machine load hits them all alike.

Scan body ops (`scan_body_ops`): the ops in the body of each while loop
of the compiled update whose trip count is the observe scan's (batch
length) or the imagination's (imag_length), forward and backward in the
order they appear: what a GPU launches per step (a fusion is one op).

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
a strict bound; docs/benchmarks.md says why) of what an update would take if
all its other work were free. `x_floor` is ms per update / floor, and
`fraction_of_peak_at_floor` the fraction of the peak that
this model's products reach at their shapes.

Variants (`--variants`), the same updates made faster, each timed in the
same rounds and reported against `base` (`x_base`): `unrollN` unrolls the
RSSM's observe and imagine scans N steps (`agent.scan_unroll`), `fuseK`
makes K updates in one compiled call (`Agent.train_many`, the learner's
`run.train_fuse`), `steps` takes the observe scan's parameter gradient
step by step (`agent.scan_grads`; base: once over all rows), and they
join with `-` (`unroll4-fuse4`). Their numbers equal base's
(tests/agent/test_train_variants.py); FLOPs and the floor are base's.

`--upstream SRC` times upstream DreamerV3's `train` at the same
configuration in the same rounds, on this interpreter and its JAX
(`upstream_learner.py` in a child process; SRC: a danijar/dreamerv3
checkout; `--upstream_site`: the folder `bench/upstream/upstream.py` installed
upstream's extra packages into) and reports ours / upstream in updates
per second (`speedup_vs_upstream`, each variant's own).

`--against REV` times our own learner at another commit of this
repository in the same rounds (its files from `git archive`, built by its
own `make` in `learner_at.py`, a child process on our allocator), the two
sides taking turns to go first, and adds `against` to each base row: its
ms per update, its scan body ops and `speedup` (its ms / ours). This is
how a change to the update is measured alone.

Our process runs on the host allocator the runtime gives a CPU process
(`jax.malloc`: mimalloc; `--malloc` to compare, the bench starts again
with it); upstream runs as shipped (glibc) unless `--upstream_malloc`
gives it another.

`--profile` traces a few base updates per configuration and adds the
ops that took the most time (`profile`: device ops where the trace has a
device, else the host's XLA ops), summed over the traced updates.
"""

import argparse
import concurrent.futures
import glob
import gzip
import json
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import elements
import jax
import numpy as np

from bench import stamp
from bench.upstream import upstream as upstreamlib
from bench.learner.learner_counts import (
    matmul_floor, matmul_ops, matmul_peak, scan_body_ops, total_flops)
from dreamer_ver.config import loading as configlib
from dreamer_ver.config.validation import CHOICES
from dreamer_ver.agent.agent import Agent
from dreamer_ver.cluster import devices
from dreamer_ver.runtime.agent_process import build_agent

MALLOCS = CHOICES['jax.malloc']
OBS = {'orientations': (14,), 'height': (), 'velocity': (9,)}
ACT = (6,)


def spaces():
  """dm_control walker's (obs_space, act_space), without dm_control."""
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
  batch = {}
  for key, space in {**agent.obs_space, **agent.act_space}.items():
    shape = (B, T, *space.shape)
    if key.startswith('log/') or space.dtype == bool:
      continue
    if np.issubdtype(space.dtype, np.floating):  # within [-1, 1] and its own
      low = np.maximum(space.low, -1).astype(np.float64)
      high = np.minimum(space.high, 1).astype(np.float64)
      batch[key] = rng.uniform(low, high, shape).astype(space.dtype)
    else:  # discrete actions, images: anywhere in their range
      batch[key] = rng.integers(space.low, space.high, shape,
                                endpoint=False).astype(space.dtype)
  for key in ('is_first', 'is_last', 'is_terminal'):
    batch[key] = np.zeros((B, T), bool)
  batch['is_first'][:, 0] = True
  batch['dyn/deter'] = np.zeros((B, T, r.deter), np.float32)
  batch['dyn/stoch'] = np.zeros((B, T, r.stoch, r.classes), np.float32)
  batch['stepid'] = np.zeros((B, T, 20), np.uint8)
  batch['consec'] = np.zeros((B, T), np.int32)
  return batch


def variant(name):
  """'base', 'unroll4', 'fuse4', 'rows', 'unroll4-fuse4', ... -> config
  overrides and fuse."""
  overrides, fuse = {'agent.scan_unroll': 1}, 1
  for part in [] if name == 'base' else name.split('-'):
    match = re.fullmatch(r'(unroll|fuse)([0-9]+)|(rows|steps)', part)
    if not match:
      raise ValueError(f'unknown variant {name!r} (base, unrollN, fuseK, '
                       'rows, steps, joined by -)')
    if match[3]:
      overrides['agent.scan_grads'] = match[3]
    elif match[1] == 'unroll':
      overrides['agent.scan_unroll'] = int(match[2])
    else:
      fuse = int(match[2])
  return overrides, fuse


def make(size, dtype, batch, length, name='base', task=''):
  overrides, fuse = variant(name)
  config = configlib.compose(['dmc_proprio', size], {
      'jax.compute_dtype': dtype, 'batch_size': batch,
      'batch_length': length, **overrides,
      **({'task': task} if task else {})})
  # A task's agent as the runtime builds it (its env's spaces).
  agent = build_agent(config) if task else Agent(*spaces(), config)
  T = length + config.replay_context
  state = agent.init_state(agent.init_params(0), 0)
  carry = agent.init_carry(batch)
  batches = [random_batch(agent, batch, T, s) for s in range(2)]
  train = agent.train
  if fuse > 1:  # each call: `fuse` updates on the two batches in turn
    batches = [jax.tree.map(lambda *xs: np.stack(xs),
                            *[batches[i % 2] for i in range(fuse)])]
    train = agent.train_many
  batches = [jax.device_put(b) for b in batches]
  compiled = train.lower(state, carry, batches[0]).compile()
  run = {'agent': agent, 'train': compiled, 'fuse': fuse, 'batches': batches,
         'params': Agent.param_count(state['params'])}
  loops = scan_body_ops(compiled.as_text())
  trips = {'observe': length, 'imagine': config.agent.imag_length}
  run['scan_ops'] = {scan: [ops for trip, ops in loops if trip == n]
                     for scan, n in trips.items()}
  if name == 'base':
    jaxpr = jax.make_jaxpr(agent._train)(state, carry, batches[0])
    run['ops'] = matmul_ops(jaxpr.jaxpr)
    run['flops'] = total_flops(run['ops'])
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    run['xla_flops_scan_once'] = float(cost.get('flops', 0))
  state, carry, _, mets = compiled(state, carry, batches[0])  # warm up
  jax.block_until_ready(mets)
  run['state'], run['carry'] = state, carry
  return run


def time_updates(run, steps):
  """Seconds per update over at least `steps` updates (whole calls of the
  variant's fused updates; the state threads through). Also appends this
  process's page faults per update to `run['faults']`."""
  state, carry = run['state'], run['carry']
  calls = -(-steps // run['fuse'])
  faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  start = time.perf_counter()
  for i in range(calls):
    state, carry, _, mets = run['train'](
        state, carry, run['batches'][i % len(run['batches'])])
  jax.block_until_ready(mets)
  seconds = time.perf_counter() - start
  faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
  run['state'], run['carry'] = state, carry
  run.setdefault('faults', []).append(round(faults / (calls * run['fuse'])))
  return seconds / (calls * run['fuse'])


def profile(run, steps, top=12):
  """The `top` XLA ops by time over `steps` base updates, from a
  `jax.profiler` trace: device ops (GPU kernels) where the trace has a
  device, else the host's; {'ops': [[name, ms per update, calls per
  update]], 'where', 'traced_ms_per_update'}."""
  folder = tempfile.mkdtemp(prefix='learner_profile_')
  with jax.profiler.trace(folder, create_perfetto_trace=True):
    time_updates(run, steps)
  trace = json.load(gzip.open(glob.glob(
      f'{folder}/**/perfetto_trace.json.gz', recursive=True)[0]))
  names = {e['pid']: e['args']['name'] for e in trace['traceEvents']
           if e.get('ph') == 'M' and e.get('name') == 'process_name'}
  device = {p for p, n in names.items() if '/device:' in n}
  host = {p for p, n in names.items() if '/host:' in n}
  where = 'device' if device else 'host'
  pids = device or host
  totals, traced = {}, 0.0
  for e in trace['traceEvents']:
    if e.get('ph') != 'X' or e.get('pid') not in pids:
      continue
    if where == 'host' and 'hlo_op' not in e.get('args', {}):
      continue  # the host's other events (Python, runtime) are not ops
    name = e['args'].get('hlo_op', e['name']) if 'args' in e else e['name']
    if name.split('.')[0] in ('while', 'conditional', 'call'):
      continue  # on the host these span their bodies' ops, counted apart
    total = totals.setdefault(name, [0.0, 0])
    total[0] += e['dur'] / 1e3
    total[1] += 1
    traced += e['dur'] / 1e3
  ops = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
  return {'where': where, 'traced_ms_per_update': round(traced / steps, 2),
          'ops': [[n, round(ms / steps, 3), round(c / steps, 1)]
                  for n, (ms, c) in ops]}


class Child:
  """A learner in a child process on this interpreter (upstream's, or ours
  at another commit), compiled and waiting for rounds: it prints one JSON
  line when ready, then one with the seconds per update for each `go`."""

  def __init__(self, argv, env):
    quiet = jax.default_backend() == 'cpu'
    self.proc = subprocess.Popen(
        [sys.executable, *argv], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True,
        stderr=subprocess.DEVNULL if quiet else None, env=env)

  def ready(self):
    """Waits for the compile and returns the ready line; RuntimeError if
    the child failed."""
    return self._read()

  def time_round(self):
    self.proc.stdin.write('go\n')
    self.proc.stdin.flush()
    return self._read()['seconds']

  def _read(self):
    for line in self.proc.stdout:  # upstream prints its own lines too
      if line.startswith('{'):
        return json.loads(line)
    raise RuntimeError(f'{self.proc.args[1]} exited with {self.proc.wait()}')

  def close(self):
    self.proc.stdin.close()
    self.proc.wait()


def upstream_child(src, site, size, dtype, batch, length, steps, malloc):
  """upstream_learner.py with upstream's allocator `malloc`."""
  script = Path(upstreamlib.__file__).with_name('upstream_learner.py')
  backend = 'cpu' if jax.default_backend() == 'cpu' else 'cuda'
  env = {k: v for k, v in upstreamlib.environ(src, site).items()
         if k not in devices.MALLOC_VARS}  # not ours: its own
  return Child(
      [str(script), src, size, dtype, str(batch), str(length), str(steps),
       backend],
      {**env, **devices.malloc_env(malloc), 'JAX_PLATFORMS': backend})


def checkout(rev):
  """(commit, folder): this repository's files at `rev`, from `git
  archive` into a temporary folder."""
  repo = Path(__file__).resolve().parents[2]
  git = lambda *a, **k: subprocess.run(
      ['git', '-C', str(repo), *a], check=True, capture_output=True, **k)
  commit = git('rev-parse', '--short', rev, text=True).stdout.strip()
  folder = tempfile.mkdtemp(prefix=f'learner_at_{commit}_')
  subprocess.run(['tar', '-x', '-C', folder], check=True,
                 input=git('archive', commit).stdout)
  return commit, folder


def against_child(folder, size, dtype, batch, length, steps):
  """learner_at.py: our learner as the files in `folder` build it, on
  this process's environment (and so its allocator)."""
  script = Path(__file__).with_name('learner_at.py')
  return Child([str(script), folder, size, dtype, str(batch), str(length),
                str(steps)], dict(os.environ))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--sizes', nargs='+', default=['size1m', 'size12m'])
  parser.add_argument('--dtypes', nargs='+', default=['float32', 'bfloat16'])
  parser.add_argument('--variants', nargs='+', default=['base'],
                      help='base, unrollN, fuseK, rows, steps, joined by - (unroll4-fuse4)')
  parser.add_argument('--batch', type=int, default=16)
  parser.add_argument('--length', type=int, default=64)
  parser.add_argument('--task', default='',
                      help="a task's spaces (default: dmc walker's)")
  parser.add_argument('--steps', type=int, default=5)
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--jobs', type=int, default=max(1, os.cpu_count() // 4),
                      help='configurations compiled at once')
  parser.add_argument('--upstream', metavar='SRC',
                      help='a danijar/dreamerv3 checkout to time beside ours')
  parser.add_argument('--upstream_site', metavar='DIR',
                      help="upstream's extra packages (bench/upstream/upstream.py); "
                      'none: they are importable already')
  parser.add_argument('--against', metavar='REV',
                      help='our learner at another commit of this '
                      'repository, timed in the same rounds (base only)')
  parser.add_argument('--floor', action=argparse.BooleanOptionalAction,
                      default=True, help='time the matmul floor (one '
                      'compile per product: minutes on a GPU)')
  parser.add_argument('--malloc', default='mimalloc', choices=MALLOCS,
                      help="our host allocator, as the runtime's jax.malloc")
  parser.add_argument('--upstream_malloc', default='glibc', choices=MALLOCS,
                      help="upstream's (glibc: as shipped)")
  parser.add_argument('--profile', action='store_true',
                      help='the top ops of a traced base update')
  parser.add_argument('--out', default='',
                      help='JSON results, rewritten after every round')
  args = parser.parse_args()
  if args.task and args.upstream:
    parser.error("--upstream times upstream on walker's spaces: no --task")
  restart = devices.malloc_restart_env(args.malloc, '', os.environ)
  if restart:  # as the runtime's command line does
    os.execve(sys.executable, sys.orig_argv, restart)
  # As the runtime (jax.prealloc False), and so that upstream's processes
  # find room beside ours on a GPU.
  os.environ.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')
  variants = ['base'] + [v for v in args.variants if v != 'base']
  for name in variants:
    variant(name)  # an unknown one fails before anything compiles
  keys = [(size, dtype, name) for size in args.sizes for dtype in args.dtypes
          for name in variants]
  children = {}  # (size, dtype, 'upstream' | 'against') -> Child
  against = checkout(args.against) if args.against else None
  for size in args.sizes:  # they compile meanwhile
    for dtype in args.dtypes:
      if args.upstream:
        children[size, dtype, 'upstream'] = upstream_child(
            args.upstream, args.upstream_site, size, dtype, args.batch,
            args.length, args.steps, args.upstream_malloc)
      if against:
        children[size, dtype, 'against'] = against_child(
            against[1], size, dtype, args.batch, args.length, args.steps)
  began = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
    futures = {key: pool.submit(make, *key[:2], args.batch, args.length,
                                key[2], args.task) for key in keys}
    for future in concurrent.futures.as_completed(futures.values()):
      future.result()  # so that a window cut short shows how far it got
      key = next(k for k, f in futures.items() if f is future)
      print(f'compiled {"/".join(key)} at '
            f'{time.perf_counter() - began:.0f} s', flush=True)
    runs = {key: futures[key].result() for key in keys}
  ready = {}
  for key, child in list(children.items()):
    try:
      ready[key] = child.ready()
      print(f'{"/".join(key)} compiled at '
            f'{time.perf_counter() - began:.0f} s', flush=True)
    except RuntimeError as e:  # ours is still measured
      print(f'{key}: {e}', flush=True)
      del children[key]
  for key, run in runs.items():  # warm-up: first-touch pages, caches
    time_updates(run, args.steps)
    run['faults'].clear()
  for key, child in children.items():
    child.time_round()
  peak_n = 2048 if jax.default_backend() == 'cpu' else 8192
  measured = {
      'peaks': {d: matmul_peak(d, peak_n) for d in args.dtypes},
      'floors': {key: matmul_floor(run['ops']) if args.floor else math.nan
                 for key, run in runs.items() if 'ops' in run},
      'times': {key: [] for key in runs},
      'theirs': {key: [] for key in children}, 'profiles': {},
      'against': against and {'commit': against[0], 'scan_body_ops': {
          key[:2]: line.get('scan_ops') for key, line in ready.items()
          if key[2] == 'against'}}}
  for round in range(args.rounds):
    for key, run in runs.items():
      sides = [(key, run)] + [
          (k, child) for k, child in children.items()
          if key[2] == 'base' and k[:2] == key[:2]]
      for k, side in sides[::-1] if round % 2 else sides:  # A B, B A, ...
        if k in runs:
          measured['times'][k].append(time_updates(side, args.steps))
        else:
          measured['theirs'][k].append(side.time_round())
    write(args, runs, measured, peak_n)
  for child in children.values():
    child.close()
  if against:
    shutil.rmtree(against[1], ignore_errors=True)
  for key, run in runs.items():
    if args.profile and key[2] == 'base':
      measured['profiles'][key] = profile(run, args.steps)
  for row in write(args, runs, measured, peak_n)['rows']:
    print(json.dumps(row), flush=True)


def write(args, runs, measured, peak_n):
  """The results so far, as a dict; into `args.out` too."""
  peaks, floors = measured['peaks'], measured['floors']
  times, theirs = measured['times'], measured['theirs']
  rows = []
  for (size, dtype, name), run in runs.items():
    base = runs[size, dtype, 'base']
    seconds = float(np.median(times[size, dtype, name]))
    floor = floors[size, dtype, 'base']
    rows.append({
        'size': size, 'dtype': dtype, 'variant': name,
        'params': run['params'],
        'ms_per_update': [round(t * 1e3, 1) for t in times[size, dtype, name]],
        'updates_per_s': round(1 / seconds, 3),
        'page_faults_per_update': run['faults'][:len(
            times[size, dtype, name])],
        'x_base': round(float(np.median(times[size, dtype, 'base'])) /
                        seconds, 3),
        'gflop_per_update': float(f"{base['flops'] / 1e9:.3g}"),
        'xla_gflop_scan_once': float(f"{base['xla_flops_scan_once'] / 1e9:.3g}"),
        'scan_body_ops': run['scan_ops'],
        'gflop_per_s': round(base['flops'] / seconds / 1e9, 1),
        'fraction_of_matmul_peak': round(
            base['flops'] / seconds / peaks[dtype], 3),
        'matmul_floor_ms': round(floor * 1e3, 1),
        'x_floor': round(seconds / floor, 2),
        'fraction_of_peak_at_floor': round(
            base['flops'] / floor / peaks[dtype], 3),
    })
    if theirs.get((size, dtype, 'upstream')):
      upstream_seconds = float(np.median(theirs[size, dtype, 'upstream']))
      rows[-1]['upstream_ms_per_update'] = [
          round(t * 1e3, 1) for t in theirs[size, dtype, 'upstream']]
      rows[-1]['speedup_vs_upstream'] = round(upstream_seconds / seconds, 2)
    if name == 'base' and theirs.get((size, dtype, 'against')):
      at = measured['against']
      rows[-1]['against'] = {
          'commit': at['commit'],
          'ms_per_update': [round(t * 1e3, 1)
                            for t in theirs[size, dtype, 'against']],
          'scan_body_ops': at['scan_body_ops'].get((size, dtype)),
          'speedup': round(float(np.median(
              theirs[size, dtype, 'against'])) / seconds, 3)}
    if (size, dtype, name) in measured['profiles']:
      rows[-1]['profile'] = measured['profiles'][size, dtype, name]
  result = {
      **stamp.stamp(), 'task': args.task or 'walker spaces',
      'batch': [args.batch, args.length],
      'steps': args.steps, 'rounds': len(next(iter(times.values()))),
      'matmul_peak_n': peak_n,
      'matmul_peak_gflop_per_s': {d: round(p / 1e9, 1)
                                  for d, p in peaks.items()},
      'rows': rows}
  if args.out:
    with open(args.out, 'w') as f:
      json.dump(result, f, indent=1)
  return result


if __name__ == '__main__':
  main()
