"""`--script eval_only`: scores of a saved agent, without training.

    python -m dreamer_ver.main --script eval_only --configs <run's blocks> \\
        --run.from_checkpoint runs/cartpole --logdir runs/cartpole/eval \\
        --run.steps 10

* Checkpoint: `run.from_checkpoint` names a logdir (its `ckpt/agent.npz` is
  read) or the checkpoint folder itself; empty means `logdir`. The config must
  build the same model as the run that saved it: pass the same `--configs`
  blocks and model flags (the run's `config.yaml` lists them); a mismatch is
  reported with the keys that differ.
* Episodes: `run.steps` is the number of episodes to run in total (not env
  steps; e.g. `--run.steps 10`). They are split evenly over
  max(1, min(`run.eval_worker_envs`, episodes)) envs built in this process, env i
  running its share to the end, so short episodes are not over-represented.
  `run.duration` (seconds, 0 = none) stops early; unfinished episodes are not
  reported.
* Actions: `run.eval_mode`: greedy (the policy's mode, the default) or
  sample (as the train actor does).
  `random_agent: True` acts uniformly at random (a baseline for the same envs).
* Envs: the run's eval envs, ids `run.envs + i`, seeded as in every script
  (`envs.make_run_env`).
* Output: one line per episode and a summary on stdout, and one JSON line per
  episode appended to `logdir/eval_scores.jsonl`: step (the checkpoint's env
  steps), env, episode, score, length, eval (true), mode, time. With
  `run.eval_video`, env 0's first episode is `logdir/videos/eval_<step>.gif`.
* The episode loop is `evaluation/episodes.py`'s, the one the EvalWorker
  (`evaluation/worker.py`) runs during training.
"""

import json
import sys
from pathlib import Path

import jax
import numpy as np

from dreamer_ver.agent.agent import Agent
from dreamer_ver.agent.checkpoint import Checkpoint, CheckpointMismatch
from dreamer_ver.cluster import devices
from dreamer_ver.envs import make_run_env
from dreamer_ver.evaluation.episodes import episode_shares, run_episodes
from dreamer_ver.logger.outputs import write_gif


def eval_only(config):
  """Runs `run.steps` episodes with the checkpointed policy; returns 0, or 2
  when there is no usable checkpoint."""
  mode = 'random' if config.random_agent else config.run.eval_mode
  logdir = Path(config.logdir)
  source = Path(config.run.from_checkpoint or config.logdir).expanduser()
  ckpt = Checkpoint(source)
  if not ckpt.exists:
    print(f'error: no checkpoint at {ckpt.directory / "agent.npz"} '
          '(set run.from_checkpoint to a logdir or its ckpt folder)',
          file=sys.stderr)
    return 2
  episodes = int(config.run.steps)
  if episodes < 1:
    print(f'error: run.steps (the number of eval episodes) must be >= 1, '
          f'got {config.run.steps}', file=sys.stderr)
    return 2

  count = max(1, min(int(config.run.eval_worker_envs), episodes))
  envs = [make_run_env(config, config.run.envs + i) for i in range(count)]
  try:
    device = devices.setup(config)[0][0]  # the first policy device
    agent = Agent(envs[0].obs_space, envs[0].act_space, config)
    template = agent.init_state(agent.init_params(config.seed), config.seed)
    try:
      state, counters = ckpt.load(template)
    except CheckpointMismatch as e:
      print(f'error: {e}', file=sys.stderr)
      hint = _config_hint(ckpt.directory.parent, config)
      if hint:
        print(hint, file=sys.stderr)
      return 2
    step = int(counters.get('steps', 0))
    print(f'Evaluating {ckpt.directory} (env step {step}): {episodes} '
          f'episodes on {count} env(s), {mode} actions.', flush=True)
    results, frames = run_episodes(
        agent, jax.device_put(state['params'], device), envs,
        episode_shares(episodes, count), mode, config.seed,
        config.run.duration, record=config.run.eval_video,
        on_episode=_printer(), max_steps=config.run.eval_max_steps)
    if len(results) < episodes:
      print(f'Stopped after run.duration = {config.run.duration} s.')
  finally:
    for env in envs:
      env.close()

  logdir.mkdir(parents=True, exist_ok=True)
  with (logdir / 'eval_scores.jsonl').open('a') as f:
    for r in results:
      record = {'step': step, **r, 'eval': True, 'mode': mode}
      f.write(json.dumps(record) + '\n')
  scores = np.array([r['score'] for r in results], float)
  if len(scores):
    print(f'Eval score over {len(scores)} episodes ({mode}, env step {step}): '
          f'mean {scores.mean():.2f} ± {scores.std():.2f} (sd), '
          f'min {scores.min():.2f}, max {scores.max():.2f}')
  else:
    print('No episode finished.')
  print(f'Wrote {logdir / "eval_scores.jsonl"}')
  if config.run.eval_video:
    if frames is None:
      print('No video: the env has no image observation or rendered frames.')
    else:
      path = logdir / 'videos' / f'eval_{step}.gif'
      write_gif(path, frames, config.logger.fps)
      print(f'Wrote {path} ({len(frames)} frames)')
  return 0


def _printer():
  """Prints each episode as it finishes, numbered in finishing order."""
  finished = []

  def on_episode(record):
    finished.append(record)
    print(f"episode {len(finished)}: env {record['env']} score "
          f"{record['score']:.2f} length {record['length']}", flush=True)
  return on_episode


def _config_hint(logdir, config):
  """The model keys where the run's config.yaml differs from `config`."""
  path = Path(logdir) / 'config.yaml'
  if not path.is_file():
    return ''
  from ruamel.yaml import YAML
  saved = _flat(YAML(typ='safe').load(path.read_text()) or {})
  ours = dict(config.flat)
  keys = [k for k in sorted(saved)
          if (k == 'task' or k.startswith(('agent.', 'env.')))
          and k in ours and _norm(saved[k]) != _norm(ours[k])]
  if not keys:
    return ''
  shown = ', '.join(f'{k}={saved[k]!r} (here {ours[k]!r})' for k in keys[:8])
  more = f' and {len(keys) - 8} more' if len(keys) > 8 else ''
  return (f'The run in {logdir} used: {shown}{more}. Pass the same --configs '
          'blocks and flags as that run.')


def _flat(tree, prefix=''):
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(_flat(v, f'{prefix}{k}.'))
    else:
      out[f'{prefix}{k}'] = v
  return out


def _norm(value):
  return tuple(value) if isinstance(value, (list, tuple)) else value
