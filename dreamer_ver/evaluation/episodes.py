"""Evaluation episodes: the one loop that `--script eval_only` and the
EvalWorker (`evaluation/worker.py`) both run.

  results, frames = run_episodes(agent, params, envs, shares, mode, seed)

steps `envs` in lockstep with one batched, jitted `agent.policy` call per
step until env i has finished `shares[i]` episodes. `params` are the policy
params (`policy_params(params)` suffices) on the device the policy runs on;
the loop keeps its own carry, so it never touches the actor's carry table.

* `mode`: 'greedy' (the policy's mode), 'sample' (as the train actor does),
  or 'random' (uniform actions, a baseline; `agent` and `params` unused).
* `results`: one dict per finished episode, in the order they finished:
  env, episode (its number on that env), score, length (steps after the
  first observation, as in `scores.jsonl`), time.
* `frames`: with `record=True`, the frames of env 0's first episode as uint8
  [T, H, W, C] when the env renders (`frame_key`), else None. Only env 0
  renders its `log/` frames (`Env.render_frames`), from its first step until
  its first episode ends; no other env and no later episode pays for them.
* `reward_keys`: the observation keys whose values, summed, are each
  step's reward (the env's own `reward` by default).
* `duration` (seconds, 0 = none) or `stop` (an Event, checked every step)
  end the loop early; unfinished episodes are not reported. With
  `break_when_any_done`, the loop ends at the first step on which any
  episode ends (those that ended on it are all reported).
"""

import time

import jax
import numpy as np

from dreamer_ver.core.transitions import is_log

MODES = ('greedy', 'sample', 'random')


def episode_shares(episodes, envs):
  """Episodes per env: `episodes` split as evenly as possible."""
  return [episodes // envs + (i < episodes % envs) for i in range(envs)]


def frame_key(obs_space):
  """The observation key to record videos from: `log/image` (rendered for
  logging only), else the first image observation; None when there is none."""
  if 'log/image' in obs_space:
    return 'log/image'
  images = sorted(k for k, s in obs_space.items()
                  if s.dtype == np.uint8 and len(s.shape) == 3)
  return images[0] if images else None


def run_episodes(agent, params, envs, shares, mode='greedy', seed=0,
                 duration=0.0, record=False, on_episode=None, stop=None,
                 max_steps=0, reward_keys=('reward',),
                 break_when_any_done=False):
  """See the module docstring. `on_episode(record)` is called as each
  episode finishes (e.g. to print it). A finished env stops stepping; its
  row keeps its last observation and the policy's output for it is
  ignored. `max_steps` (0 = none) cuts an episode after that many steps:
  it counts, with `truncated: True`, and the env is reset."""
  if mode not in MODES:
    raise ValueError(f'mode must be one of {MODES}, got {mode!r}')
  if len(shares) != len(envs) or min(shares, default=0) < 1:
    raise ValueError(
        f'every env needs a share of at least one episode; got {shares} for '
        f'{len(envs)} env(s)')
  n = len(envs)
  act_space = envs[0].act_space
  image_key = frame_key(envs[0].obs_space) if record else None
  frames = []
  acts = {k: np.zeros((n, *s.shape), s.dtype) for k, s in act_space.items()}
  acts['reset'][:] = True
  carry = agent.init_carry(n) if mode != 'random' else None
  key = jax.random.PRNGKey(seed)
  rng = np.random.default_rng(seed)
  active = [True] * n
  done = [0] * n
  score, length = [0.0] * n, [0] * n
  last = [None] * n
  results = []
  start = time.time()
  if image_key:
    envs[0].render_frames(True)
  while any(active):
    if duration and time.time() - start > duration:
      break
    if stop is not None and stop.is_set():
      break
    for i, env in enumerate(envs):
      if active[i]:
        last[i] = env.step({k: v[i] for k, v in acts.items()})
    if image_key and done[0] == 0:
      frames.append(np.asarray(last[0][image_key], np.uint8))
      if last[0]['is_last']:
        envs[0].render_frames(False)
    obs = {k: np.stack([o[k] for o in last]) for k in last[0]
           if not is_log(k)}
    if mode == 'random':
      act = {k: _random(rng, s, n) for k, s in act_space.items()
             if k != 'reset'}
    else:
      key, policy_key = jax.random.split(key)
      carry, act, _ = agent.policy(params, carry, obs, policy_key, mode)
      act = jax.device_get(act)
    acts = {**{k: np.asarray(v) for k, v in act.items()},
            'reset': obs['is_last'].copy()}
    reward = np.sum([obs[k] for k in reward_keys], 0, np.float64)
    for i in range(n):
      if not active[i]:
        continue
      if obs['is_first'][i]:
        score[i], length[i] = 0.0, 0
      score[i] += float(reward[i])
      length[i] += 1
      # As `scores.jsonl`: the first observation is not a step.
      cut = bool(max_steps) and length[i] - 1 >= max_steps and not (
          obs['is_last'][i])
      if obs['is_last'][i] or cut:
        acts['reset'][i] = True
        record = {'env': i, 'episode': done[i], 'score': score[i],
                  'length': length[i] - 1, 'time': time.time(),
                  'truncated': cut}
        results.append(record)
        if on_episode:
          on_episode(record)
        done[i] += 1
        active[i] = done[i] < shares[i]
    if break_when_any_done and results:
      break
  if image_key:  # Cut short (duration, stop, a break): env 0 may render.
    envs[0].render_frames(False)
  return results, (np.stack(frames) if frames else None)


def _random(rng, space, n):
  if space.discrete:
    return rng.integers(space.low, space.high, (n, *space.shape)).astype(
        space.dtype)
  return rng.uniform(space.low, space.high, (n, *space.shape)).astype(
      space.dtype)
