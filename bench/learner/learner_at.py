"""Our learner at another commit, run by `learner_bench.py --against REV`
so that a change to the update is timed against the code before it in
the same rounds, each side in its own process.

  python bench/learner/learner_at.py ROOT SIZE DTYPE BATCH LENGTH STEPS

ROOT: that commit's files (`git archive`). Its own `learner_bench.make`
builds and compiles the update, so the two sides differ in their code
only. Prints one JSON line when compiled ({'ready', 'scan_ops'}), then
the seconds per update of STEPS updates for each line `go` on stdin.
"""

import json
import sys


def main():
  root, size, dtype = sys.argv[1:4]
  batch, length, steps = map(int, sys.argv[4:7])
  sys.path[0] = root  # that commit's packages, not this folder's modules
  from bench.learner import learner_bench
  run = learner_bench.make(size, dtype, batch, length)
  learner_bench.time_updates(run, steps)  # first-touch pages, caches
  print(json.dumps({'ready': True, 'scan_ops': run.get('scan_ops')}),
        flush=True)
  for line in sys.stdin:
    if line.strip() != 'go':
      break
    print(json.dumps({'seconds': learner_bench.time_updates(run, steps)}),
          flush=True)


if __name__ == '__main__':
  main()
