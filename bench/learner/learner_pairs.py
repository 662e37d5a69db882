"""Learner ratios with every side in fresh processes: ours at this checkout
against ours at another commit (`--against`) and upstream (`--upstream`).

On a VM a process can run the same compiled update 5-40 % slower than the
next one for its whole life (docs/benchmarks.md, the learner section), and
`learner_bench.py` times ours in its own process and the others in
children: one pair of processes is one draw of that. Here each side is a
child of its own, started again for each of `--pairs` pairs; within a pair
the sides take turns (A B, B A, ...) for `--rounds` rounds. Each pair's
ratio is the other side's median over ours; the result is the ratios and
their median.

  python -m bench.learner.learner_pairs --against REV \\
      [--upstream SRC --upstream_site DIR --upstream_malloc mimalloc] \\
      [--size size1m --dtype float32 --pairs 4 --rounds 4 --steps 8]
"""

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from bench import stamp
from bench.learner import learner_bench
from dreamer_ver.cluster import devices

ROOT = Path(__file__).resolve().parents[2]


def pair_ratios(times):
  """{side: [seconds per round]} of one pair -> {side: ours' speedup}:
  the side's median over ours' ('ours' itself left out)."""
  ours = float(np.median(times['ours']))
  return {side: round(float(np.median(t)) / ours, 3)
          for side, t in times.items() if side != 'ours'}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--size', default='size1m')
  parser.add_argument('--dtype', default='float32')
  parser.add_argument('--batch', type=int, default=16)
  parser.add_argument('--length', type=int, default=64)
  parser.add_argument('--steps', type=int, default=8)
  parser.add_argument('--rounds', type=int, default=4)
  parser.add_argument('--pairs', type=int, default=4)
  parser.add_argument('--against', metavar='REV')
  parser.add_argument('--upstream', metavar='SRC')
  parser.add_argument('--upstream_site', metavar='DIR')
  parser.add_argument('--malloc', default='mimalloc',
                      choices=learner_bench.MALLOCS,
                      help="ours' host allocator, as the runtime's jax.malloc")
  parser.add_argument('--upstream_malloc', default='glibc',
                      choices=learner_bench.MALLOCS)
  parser.add_argument('--out', default='')
  args = parser.parse_args()
  if not (args.against or args.upstream):
    parser.error('nothing to compare: --against and/or --upstream')
  restart = devices.malloc_restart_env(args.malloc, '', os.environ)
  if restart:  # our children inherit it, as a CPU run's processes do
    os.execve(sys.executable, sys.orig_argv, restart)
  shape = (args.size, args.dtype, args.batch, args.length, args.steps)
  against = learner_bench.checkout(args.against) if args.against else None
  sides = {'ours': lambda: learner_bench.against_child(str(ROOT), *shape)}
  if against:
    sides['against'] = lambda: learner_bench.against_child(against[1], *shape)
  if args.upstream:
    sides['upstream'] = lambda: learner_bench.upstream_child(
        args.upstream, args.upstream_site, *shape, args.upstream_malloc)
  pairs = []
  try:
    for pair in range(args.pairs):
      began = time.perf_counter()
      children = {side: start() for side, start in sides.items()}
      for child in children.values():
        child.ready()
      for child in children.values():  # warm-up round
        child.time_round()
      times = {side: [] for side in children}
      for turn in range(args.rounds):
        order = list(children)[::-1] if turn % 2 else list(children)
        for side in order:
          times[side].append(children[side].time_round())
      for child in children.values():
        child.close()
      pairs.append({
          'ms_per_update': {side: [round(t * 1e3, 1) for t in ts]
                            for side, ts in times.items()},
          'speedup': pair_ratios(times)})
      print(json.dumps({'pair': pair, **pairs[-1],
                        'seconds': round(time.perf_counter() - began)}),
            flush=True)
  finally:
    if against:
      shutil.rmtree(against[1], ignore_errors=True)
  result = {
      **stamp.stamp(), 'size': args.size, 'dtype': args.dtype,
      'batch': [args.batch, args.length], 'steps': args.steps,
      'rounds': args.rounds, 'malloc': args.malloc,
      'against': against and against[0],
      'upstream_malloc': args.upstream and args.upstream_malloc,
      'pairs': pairs,
      'median_speedup': {side: float(np.median(
          [p['speedup'][side] for p in pairs])) for side in sides
          if side != 'ours'}}
  print(json.dumps(result['median_speedup']), flush=True)
  if args.out:
    Path(args.out).write_text(json.dumps(result, indent=1) + '\n')


if __name__ == '__main__':
  sys.exit(main())
