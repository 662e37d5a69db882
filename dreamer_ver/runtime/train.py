"""`--script train`: the whole loop in one process, envs stepped in turn.

The simplest way to train: no sockets, no threads. It shares the agent,
replay and checkpoint formats with the parallel runtime, so it is also the
reference the parallel runtime is compared against.
"""

import collections
import json
import time
from pathlib import Path

import elements
import jax
import numpy as np

from dreamer_ver.agent.agent import Agent
from dreamer_ver.envs import make_env
from dreamer_ver.replay import Replay
from dreamer_ver.runtime import devices
from dreamer_ver.runtime.learner import Checkpoint


def train(config):
  logdir = Path(config.logdir)
  _, device = devices.setup(config)  # one process: policy and learner share it
  envs = [make_env(config.task, config.env, config.seed * 1000 + i)
          for i in range(config.run.envs)]
  agent = Agent(envs[0].obs_space, envs[0].act_space, config)
  replay = Replay(
      config.batch_length + config.replay_context, int(config.replay.size),
      logdir / 'replay', config.replay.chunksize, config.replay.online,
      seed=config.seed)
  ckpt = Checkpoint(logdir)
  state = agent.init_state(agent.init_params(config.seed), config.seed)
  counters = {'steps': 0, 'version': 0}  # version: updates made
  if ckpt.exists:
    state, counters = ckpt.load(state)
    print(f'Resumed from {ckpt.directory} at step {counters["steps"]}.')
  state = jax.device_put(state, device)
  replay.load()
  logger = make_logger(logdir, counters['steps'], config)
  scores = ScoreWriter(logdir / 'scores.jsonl')

  carry = agent.init_carry(len(envs))
  train_carry = agent.init_carry(config.batch_size)
  acts = {k: np.zeros((len(envs), *s.shape), s.dtype)
          for k, s in envs[0].act_space.items()}
  acts['reset'][:] = True
  episodes = [collections.defaultdict(float) for _ in envs]
  # Train steps owed per env step: replayed steps / (steps per train batch).
  train_every = config.batch_size * config.batch_length / config.run.train_ratio
  credit = 0.0
  key = jax.random.PRNGKey(config.seed)
  metrics = collections.defaultdict(list)
  should_log = elements.when.Clock(config.run.log_every)
  should_save = elements.when.Clock(config.run.save_every)
  fps_policy, fps_train = elements.FPS(), elements.FPS()
  minsize = config.batch_size * config.batch_length  # as upstream's limiter

  while counters['steps'] < config.run.steps:
    obs = [env.step({k: v[i] for k, v in acts.items()})
           for i, env in enumerate(envs)]
    obs = {k: np.stack([o[k] for o in obs]) for k in obs[0]
           if not k.startswith('log/')}
    key, policy_key = jax.random.split(key)
    carry, act, outs = agent.policy(state['params'], carry, obs, policy_key)
    act, outs = jax.device_get((act, outs))
    acts = {**act, 'reset': obs['is_last'].copy()}
    for i in range(len(envs)):
      step = {k: v[i] for k, v in {**obs, **act, **outs}.items()}
      replay.add(step, worker=i)
      track_episode(episodes[i], obs, i, scores, logger, counters['steps'])
    counters['steps'] += len(envs)
    fps_policy.step(len(envs))

    credit += len(envs) / train_every
    while credit >= 1 and len(replay) >= minsize:
      credit -= 1
      batch = replay.sample(config.batch_size)
      state, train_carry, outs, mets = agent.train(state, train_carry, batch)
      replay.update(jax.device_get(outs['replay']))
      counters['version'] += 1
      fps_train.step(config.batch_size * config.batch_length)
      for k, v in mets.items():
        metrics[k].append(v)

    if should_log():
      logger.step.load(counters['steps'])
      logger.add({k: np.mean(jax.device_get(v)) for k, v in metrics.items()},
                 prefix='train')
      logger.add({'fps/policy': fps_policy.result(),
                  'fps/train': fps_train.result(),
                  'replay/size': len(replay),
                  'train/updates': counters['version']})
      logger.write()
      metrics.clear()
    if should_save():
      ckpt.save(state, counters)
      replay.save()

  ckpt.save(state, counters)
  replay.save(wait=True)
  replay.close()
  logger.step.load(counters['steps'])
  logger.write()
  logger.close()
  for env in envs:
    env.close()


def track_episode(episode, obs, index, scores, logger, step):
  if obs['is_first'][index]:
    episode.clear()
  episode['score'] += float(obs['reward'][index])
  episode['length'] += 1
  if obs['is_last'][index]:
    score, length = episode['score'], int(episode['length']) - 1
    scores.write(step, index, score, length)
    logger.add({'episode/score': score, 'episode/length': length})


class ScoreWriter:
  """One JSON line per finished episode: what the plotting tools read."""

  def __init__(self, path):
    self.path = path

  def write(self, step, env, score, length):
    record = {'step': int(step), 'env': int(env), 'score': score,
              'length': length, 'time': time.time()}
    with self.path.open('a') as f:
      f.write(json.dumps(record) + '\n')


def make_logger(logdir, step, config):
  counter = elements.Counter(step)
  outputs = [elements.logger.TerminalOutput(config.logger.filter)]
  if 'jsonl' in config.logger.outputs:
    outputs.append(elements.logger.JSONLOutput(logdir, 'metrics.jsonl'))
  if 'tensorboard' in config.logger.outputs:
    outputs.append(elements.logger.TensorBoardOutput(logdir))
  return elements.Logger(counter, outputs)
