"""`--script train`: the whole loop in one process, envs stepped in turn.

The simplest way to train: no sockets, no threads. It shares everything but
the transport with the parallel runtime -- env seeds, the agent and its
checkpoint, the replay and its limiter (`run.train_ratio`), and the logger
service that counts steps and episodes and writes `metrics.jsonl` and
`scores.jsonl` -- so it is also the reference the parallel runtime is
compared against.

With `run.eval_every`, an EvalWorker process (`evaluation/worker.py`)
scores the params this loop publishes every `run.eval_every` seconds, on
its own thread; its rows join the next metrics write. SIGINT or SIGTERM
ends the loop after its step; the run saves and exits 0 like the others.
"""

import collections
import json
import time
from pathlib import Path

import elements
import jax
import numpy as np

from dreamer_ver.agent import checkpoint
from dreamer_ver.agent.agent import Agent, policy_params
from dreamer_ver.cluster import devices
from dreamer_ver.cluster.signals import StopSignal, every
from dreamer_ver.envs import make_run_env
from dreamer_ver.evaluation.periodic import PeriodicEvaluation
from dreamer_ver.core.atomic import write_json
from dreamer_ver.logger.service import LoggerService
from dreamer_ver.logger.summary import summary
from dreamer_ver.replay import build
from dreamer_ver.core.transitions import is_log


def train(config):
  stop = StopSignal()  # Set during start-up too: the loop then saves at once.
  began = time.monotonic()
  try:
    code = _train(config, stop)
  finally:
    stop.restore()
  print(summary(config.logdir, time.monotonic() - began), flush=True)
  return code


def _train(config, stop):
  logdir = Path(config.logdir)
  run = config.run
  # One process, one device: policy and learner share it.
  _, (device,) = devices.setup(config)
  envs = [make_run_env(config, i) for i in range(run.envs)]
  agent = Agent(envs[0].obs_space, envs[0].act_space, config)
  ckpt, state, counters = checkpoint.restore(
      agent, config.logdir, config.seed, config.run.from_checkpoint,
      config.run.keep_checkpoints)
  state = jax.device_put(state, device)
  options = build.Options.of(config)
  replay = build.train_replay(options, logdir)
  replay.load()
  limiter = build.make_limiter(options)
  limiter_path = logdir / 'ckpt' / 'replay.json'
  if limiter_path.exists():
    limiter.load(json.loads(limiter_path.read_text())['limiter'])
  logger = LoggerService.of(config)
  logger.load()

  carry = agent.init_carry(len(envs))
  train_carry = agent.init_carry(config.batch_size)
  acts = {k: np.zeros((len(envs), *s.shape), s.dtype)
          for k, s in envs[0].act_space.items()}
  acts['reset'][:] = True
  envids = np.arange(len(envs))
  key = jax.random.PRNGKey(config.seed)
  metrics = collections.defaultdict(list)
  should_log = every(run.log_every)
  should_save = every(run.save_every)
  fps_policy, fps_train = elements.FPS(), elements.FPS()
  # The evaluation thread reads only this snapshot (the loop donates the
  # train state's buffers) and hands its rows over through `eval_rows`.
  snapshot = lambda: (jax.device_get(policy_params(state['params'])),
                      counters['version'])
  published, eval_rows = [], []
  should_publish = every(run.eval_every)
  evaluation = None
  if run.eval_every > 0:
    published.append(snapshot())
    evaluation = PeriodicEvaluation.of(
        config, lambda: published[-1], lambda: counters['version'],
        eval_rows.append).start()
  start = time.monotonic()

  def save():
    ckpt.save(state, counters)
    replay.save(wait=True)
    write_json(limiter_path, {'limiter': limiter.save()})
    logger.save()

  try:
    while counters['steps'] < run.steps and not stop and not (
        run.duration > 0 and time.monotonic() - start >= run.duration):
      obs = [env.step({k: v[i] for k, v in acts.items()})
             for i, env in enumerate(envs)]
      obs = {k: np.stack([o[k] for o in obs]) for k in obs[0]}
      logs = {k: v for k, v in obs.items() if is_log(k)}
      obs = {k: v for k, v in obs.items() if not is_log(k)}
      key, policy_key = jax.random.split(key)
      carry, act, outs = agent.policy(state['params'], carry, obs, policy_key)
      act, outs = jax.device_get((act, outs))
      acts = {**act, 'reset': obs['is_last'].copy()}
      for i in range(len(envs)):
        replay.add({k: v[i] for k, v in {**obs, **act, **outs}.items()},
                   worker=i)
      limiter.insert(len(envs))
      logger.transitions({**obs, **logs, 'envid': envids,
                   'is_eval': np.zeros(len(envs), bool)})
      counters['steps'] += len(envs)
      fps_policy.step(len(envs))

      # One thread: sample only what the replay holds, or it would wait forever.
      while len(replay) and limiter.want_sample()[0]:
        limiter.sample(config.batch_size)  # The limiter counts sequences.
        batch = replay.sample(config.batch_size)
        state, train_carry, outs, mets = agent.train(state, train_carry, batch)
        if 'replay' in outs:
          replay.update(jax.device_get(outs['replay']))
        counters['version'] += 1
        fps_train.step(config.batch_size * config.batch_length)
        for k, v in mets.items():
          metrics[k].append(v)

      if evaluation is not None and should_publish():
        published.append(snapshot())
        del published[:-1]
      if should_log():
        while eval_rows:
          logger.add(eval_rows.pop(0))
        logger.add({f'train/{k}': np.mean(jax.device_get(v))
                    for k, v in metrics.items()})
        logger.add({'fps/policy': fps_policy.result(),
                    'fps/train': fps_train.result(),
                    'replay/size': len(replay),
                    'train/updates': counters['version']})
        logger.write()
        metrics.clear()
      if should_save():
        save()
  finally:
    if evaluation is not None:
      # Also when the loop raised: a worker left running would keep
      # this process from exiting. It ends after the save.
      evaluation.stop.set()

  save()
  if evaluation is not None:
    evaluation.close(timeout=30)
  replay.close()
  for row in eval_rows:
    logger.add(row)
  logger.write()
  logger.close()
  for env in envs:
    env.close()
