"""The eval worker's test task and hand-built params whose scores are
known: the cue params score the maximum (`LENGTH`) or nothing; and a
worker's parts for library use without a run config (`counting_env`,
`idle_policy`), whose scores are known whatever the params."""

import json
import os
import subprocess
import sys

import elements
import jax
import numpy as np
import pytest

from dreamer_ver.config import loading as configlib
from dreamer_ver.agent.agent import Agent, policy_params
from dreamer_ver.envs import make_run_env
from dreamer_ver.envs.base import Env, basic_obs, basic_obs_space

LENGTH = 10
STEP_TIME = 0.02  # seconds per env step: an evaluation lasts long enough to poll
# Unimix 0: the latent that carries the cue is then exactly its class, and
# a sampled action the policy's mode (with 0.01, about one step in 130 would
# draw another class at random).
FLAGS = ['--configs', 'debug', '--task', 'synthetic_bandit',
         '--env.synthetic.length', str(LENGTH),
         '--env.synthetic.step_time', str(STEP_TIME),
         '--agent.rssm.unimix', '0', '--agent.policy.unimix', '0',
         '--run.eval_worker_envs', '2']
MARGIN = 100.0  # logit gap: no other class keeps any probability


@pytest.fixture(scope='module')
def config(tmp_path_factory):
  logdir = tmp_path_factory.mktemp('run')
  return configlib.load_config([*FLAGS, '--logdir', str(logdir)])


@pytest.fixture(scope='module')
def agent(config):
  env = make_run_env(config, config.run.envs)
  yield Agent(env.obs_space, env.act_space, config)
  env.close()


def cue_params(agent, best=True):
  """Policy params whose action is the cue (`best`) or its opposite.

  One path carries vector[0] (the cue), all other weights on it are zero:
  encoder units 0 and 1 get +-(cue - 1/2), the posterior's units 0 and 1
  their difference, latent 0 takes class 1 for cue 1 and class 0 for cue 0
  (by MARGIN), the policy's units 0 and 1 get +-(class 1 - class 0), and the
  action logits +-MARGIN times theirs. Each RMS norm sees two opposite units,
  so every sign survives it."""
  params = jax.tree.map(np.array, policy_params(agent.init_params(0)))
  enc = params['enc']['mlp']['layer0']['linear']
  # The encoder's input is symlog of [count, vector] (sorted keys).
  assert sorted(agent.model_space) == ['count', 'vector']
  cue = 1
  half = float(np.log1p(1.0)) / 2  # symlog(cue) is 0 or log(2)
  enc['kernel'][:] = 0
  enc['bias'][:] = 0
  enc['kernel'][cue, :2] = [10, -10]
  enc['bias'][:2] = [-10 * half, 10 * half]
  deter = agent.config.agent.rssm.deter
  post = params['dyn']['obs0']['linear']
  post['kernel'][:] = 0
  post['bias'][:] = 0
  post['kernel'][deter:deter + 2, 0] = [1, -1]  # tokens 0 and 1
  post['kernel'][deter:deter + 2, 1] = [-1, 1]
  logit = params['dyn']['obslogit']
  logit['kernel'][:] = 0
  logit['bias'][:] = 0
  logit['kernel'][:2, 1] = [MARGIN, -MARGIN]  # latent 0, class 1
  logit['kernel'][:2, 0] = [-MARGIN, MARGIN]  # latent 0, class 0
  pol = params['pol']['mlp']['layer0']['linear']
  pol['kernel'][:] = 0
  pol['bias'][:] = 0
  pol['kernel'][deter:deter + 2, 0] = [-1, 1]  # latent 0's classes 0, 1
  pol['kernel'][deter:deter + 2, 1] = [1, -1]
  head = params['pol']['action_logits']
  sign = 1 if best else -1
  head['kernel'][:] = 0
  head['bias'][:] = 0
  head['kernel'][:2, 1] = [sign * MARGIN, -sign * MARGIN]
  head['kernel'][:2, 0] = [-sign * MARGIN, sign * MARGIN]
  return params


def poll_from_another_process(name, logdir):
  """[version, scores] of the result that `EvalWorker.from_name(name,
  logdir).poll()` gets in a fresh Python process."""
  script = (
      'import json, sys\n'
      'from dreamer_ver.evaluation.worker import EvalWorker\n'
      'worker = EvalWorker.from_name(sys.argv[1], sys.argv[2])\n'
      'result = worker.poll(timeout=120)\n'
      'print(json.dumps([result["version"], result["scores"]]))\n'
      'worker.close()\n')
  done = subprocess.run(
      [sys.executable, '-c', script, name, str(logdir)], capture_output=True,
      text=True, timeout=300, env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
  assert done.returncode == 0, done.stderr
  return json.loads(done.stdout.splitlines()[-1])


class CuePolicy:
  """A user's policy for the eval worker (`policy_maker`): acts the cue
  XOR `params['flip']`, so flip 0 scores LENGTH and flip 1 scores 0.
  It has the agent's policy interface: init_params, init_carry, policy."""

  def __init__(self, obs_space, act_space):
    self.act_space = act_space

  def init_params(self, seed):
    del seed
    return {'flip': np.zeros((), np.int32)}

  def init_carry(self, batch):
    return np.zeros((batch,), np.int32)

  def policy(self, params, carry, obs, key, mode):
    del key, mode
    cue = (np.asarray(obs['vector'])[:, 0] > 0.5).astype(np.int32)
    action = np.bitwise_xor(cue, np.asarray(params['flip'], np.int32))
    return carry, {'action': action}, {}


def cue_policy(obs_space, act_space):
  return CuePolicy(obs_space, act_space)


class Counting(Env):
  """Episodes of `length` steps whose observations give a = 1, b = `B` (2)
  and reward = 5 on each step (all 0 on the reset), whatever the actions."""

  B = np.float32(2)

  def __init__(self, length):
    self.length = length
    self.count = length  # The first step resets.

  @property
  def obs_space(self):
    return {'a': elements.Space(np.float32), 'b': elements.Space(np.float32),
            **basic_obs_space()}

  @property
  def act_space(self):
    return {'reset': elements.Space(bool),
            'action': elements.Space(np.int32, (), 0, 2)}

  def step(self, action):
    if action['reset'] or self.count >= self.length:
      self.count = 0
      return {'a': np.float32(0), 'b': np.float32(0),
              **basic_obs(is_first=True)}
    self.count += 1
    last = self.count >= self.length
    return {'a': np.float32(1), 'b': self.B,
            **basic_obs(5.0, is_last=last, is_terminal=last)}


COUNTING_LENGTHS = (3, 10)  # of env 0's and env 1's episodes


def counting_env(index):
  return Counting(COUNTING_LENGTHS[index])


def counting_b_ten():
  """An EvalWorker's `init_fn`: Counting envs made after it give b = 10."""
  Counting.B = np.float32(10)


class IdlePolicy(CuePolicy):
  """CuePolicy's params and carry, acting 0 whatever it sees (an env
  without a cue)."""

  def policy(self, params, carry, obs, key, mode):
    del params, key, mode
    return carry, {'action': np.zeros(len(obs['is_first']), np.int32)}, {}


def idle_policy(obs_space, act_space):
  return IdlePolicy(obs_space, act_space)
