"""The agent really learns, through the real parallel runtime.

The task is the synthetic contextual bandit: reward 1 when the action equals
the cue shown in the previous observation, so a random policy scores half
the episode length and a learned one all of it.
"""

import json
import os
import subprocess
import sys

import numpy as np

from helpers import ROOT
LENGTH = 20


def test_bandit_policy_beats_random_by_a_clear_margin(tmp_path):
  logdir = tmp_path / 'bandit'
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'PYTHONUNBUFFERED': '1'}
  env.pop('XLA_FLAGS', None)  # trains for real: XLA's optimised code
  proc = subprocess.run(
      [sys.executable, '-m', 'dreamer_ver.main', '--script', 'parallel',
       '--configs', 'debug', '--task', 'synthetic_bandit',
       '--logdir', str(logdir), '--run.steps', '2400',
       '--env.synthetic.length', str(LENGTH), '--run.train_ratio', '64',
       # Debug's 5 two-hot bins cannot represent rewards of 1 (the bins are
       # 0 and 22026), and its 8-unit nets learn slowly: a small real model.
       '--.*\\.bins', '255', '--.*\\.units', '32',
       '--agent.rssm.deter', '32', '--agent.rssm.hidden', '32',
       '--agent.opt.lr', '1e-3', '--agent.opt.warmup', '100'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
  scores = [json.loads(l) for l in (logdir / 'scores.jsonl').open()]
  train = [s['score'] for s in scores if not s['eval']]
  evals = [s['score'] for s in scores if s['eval']]
  random_score = LENGTH / 2
  assert np.mean(train[:8]) < random_score + 3  # It starts out random...
  # ...and learns. On a failure, the learner's curves say why (a rare late
  # collapse was seen once and not reproduced in 13 runs).
  assert np.mean(train[-8:]) >= random_score + 6, (train, _curves(logdir))
  assert evals and np.mean(evals[-3:]) >= random_score + 6, evals


def _curves(logdir, keys=(
    'train/ent/action', 'train/rand/action', 'train/loss/policy',
    'train/adv_std', 'train/val', 'train/ret', 'train/retnorm/hi',
    'train/retnorm/lo', 'train/loss/rew', 'train/opt/grad_norm')):
  """Each key's values over the run (the learner's log lines), rounded."""
  lines = [json.loads(l) for l in (logdir / 'metrics.jsonl').open()]
  return {key: [(m['step'], round(m[key], 4)) for m in lines if key in m]
          for key in keys}
