"""End to end: the parallel runtime on the debug config, as a user runs it."""

import json
import os
import shlex
import subprocess
import sys

import pytest

from dreamer_ver.config import loading as config_module
from helpers import ROOT, runs
from helpers.envs import rendered_dmc

FLAGS = ['--configs', 'debug', '--task', 'synthetic_bandit',
         '--env.synthetic.length', '20',
         '--run.log_every', '2', '--run.save_every', '5']


def _run(args, timeout=300):
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'PYTHONUNBUFFERED': '1',
         'PYTHON': sys.executable}
  proc = subprocess.run(
      args, cwd=ROOT, env=env, capture_output=True, text=True,
      timeout=timeout)
  return proc.returncode, proc.stdout + proc.stderr


def _main(*args):
  return _run([sys.executable, '-m', 'dreamer_ver.main', *args])


def test_parallel_runs_to_steps_writes_every_output_and_resumes(
    tmp_path, monkeypatch):
  """A debug run with every logger output (W&B offline: no network, no
  TensorFlow for TensorBoard), then the same command with more steps."""
  from tensorboard.backend.event_processing.event_accumulator import (
      EventAccumulator)
  from helpers.wandb_log import wandb_history
  for name in ('CONFIG_DIR', 'CACHE_DIR', 'DATA_DIR'):
    monkeypatch.setenv(f'WANDB_{name}', str(tmp_path / 'wandb_home'))
  logdir = tmp_path / 'run'
  outputs = ['--logger.outputs', 'jsonl', 'tensorboard', 'wandb',
             '--logger.wandb_mode', 'offline']
  code, out = _main('--script', 'parallel', '--logdir', str(logdir),
                    '--run.steps', '600', *FLAGS, *outputs)
  assert code == 0, out[-3000:]
  # A clean terminal: no connection chatter, no step-0 lines while the
  # agent compiles (a line per compile stage instead), and a summary.
  for noise in ('Accepted connection', 'Binding to', '] step 0 |',
                'ConnectionResetError'):
    assert noise not in out, (noise, out[-3000:])
  assert 'Compiling the policy for batches of' in out
  end = out.rfind('Run ended at env step')
  assert end > out.rfind('[logger] step '), out[-3000:]  # After the progress.
  assert 'resume:   run the same command again' in out[end:]
  counters = json.loads((logdir / 'ckpt' / 'counters.json').read_text())
  # The envs act while the learner compiles, up to the replay limiter's
  # allowance before the first sample (212 steps here) plus the actor's
  # shipments in flight; a 300-step run could end there, before an update.
  assert counters['steps'] >= 600 and counters['version'] >= 1, counters
  for name in ('ckpt/agent.npz', 'ckpt/replay.json', 'ckpt/logger.json',
               'metrics.jsonl', 'scores.jsonl', 'config.yaml'):
    assert (logdir / name).exists(), name
  assert list((logdir / 'replay').glob('*.npz')), 'no replay chunks saved'
  metrics = [json.loads(l) for l in (logdir / 'metrics.jsonl').open()]
  keys = set().union(*metrics)
  assert {'train/loss/dyn', 'fps/train', 'fps/policy',
          'replay/items'} <= keys, sorted(keys)
  # The batch-size histogram: one count per power-of-two bin, summing to
  # the batches of the same log interval (also where two reports of the
  # actor fell into it); no bin above the 5 envs (4 + 1 eval).
  hists = [(m['actor/batches'], {int(k.rsplit('/', 1)[1]): v
                                 for k, v in m.items()
                                 if k.startswith('actor/batch_size/')})
           for m in metrics if 'actor/batches' in m]
  assert any(h for _, h in hists), 'no batch-size histogram logged'
  for batches, hist in hists:
    assert sum(hist.values()) == batches, (batches, hist)
    assert all(1 <= size <= 5 for size in hist), hist
  scores = [json.loads(l) for l in (logdir / 'scores.jsonl').open()]
  assert scores and all(s['length'] == 20 for s in scores)
  assert (logdir / 'pids' / 'replay').exists()
  assert not runs.children_alive(logdir), 'child processes left behind'

  # TensorBoard and W&B hold what metrics.jsonl holds.
  key = 'episode/score'
  jsonl = {r['step']: r[key] for r in metrics if key in r}
  assert jsonl
  events = EventAccumulator(str(logdir))
  events.Reload()
  tensorboard = {e.step: e.value for e in events.Scalars(key)}
  assert tensorboard == pytest.approx(jsonl)  # float32 in the event file
  (wandb_log,) = logdir.glob('wandb/offline-run-*/run-*.wandb')
  history = wandb_history(wandb_log)
  assert {step: row[key] for step, row in history.items()
          if key in row} == pytest.approx(jsonl)

  logger_step = json.loads((logdir / 'ckpt' / 'logger.json').read_text())
  # The rerun ends by itself at its duration (seconds of serving, which
  # begin while the learner still compiles: with another test beside it,
  # 10 s passed before its first update, so 30).
  code, out = _main('--script', 'parallel', '--logdir', str(logdir),
                    '--run.steps', '1e9', '--run.duration', '30', *FLAGS,
                    *outputs)
  assert code == 0, out[-3000:]
  assert f'Agent resumed at step {counters["steps"]}' in out, out[-3000:]
  resumed = json.loads((logdir / 'ckpt' / 'counters.json').read_text())
  # The rerun's envs acted and its learner trained; how far depends on the
  # machine (174 steps in 10 s on a slow one), so no count is set.
  assert counters['steps'] < resumed['steps'] < 1e9, resumed
  assert resumed['version'] > counters['version']
  logger_now = json.loads((logdir / 'ckpt' / 'logger.json').read_text())
  assert logger_now['step'] > logger_step['step']


@pytest.mark.skipif(sys.platform != 'linux', reason='bash launch script')
def test_launch_script_runs_components_as_separate_processes(tmp_path):
  logdir = tmp_path / 'split'
  code, out = _run(
      ['bash', 'launch/local.sh', str(logdir), '--run.steps', '200', *FLAGS],
      timeout=300)
  assert code == 0, out[-3000:]
  counters = json.loads((logdir / 'ckpt' / 'counters.json').read_text())
  assert counters['steps'] >= 200
  assert (logdir / 'ckpt' / 'replay.json').exists()
  assert (logdir / 'metrics.jsonl').exists()


def test_parallel_runs_the_dmc_proprio_preset(tmp_path):
  """dm_control from state, as the `dmc_proprio` preset runs it: the train
  envs never render `log/image`; the eval worker renders it for its first
  episode only, which becomes the video `eval/video`."""
  rendered_dmc({})  # Skips where MuJoCo cannot render.
  from PIL import Image
  logdir, log = tmp_path / 'dmc', tmp_path / 'dmc.log'
  proc = runs.start([
      '--script', 'parallel', '--logdir', str(logdir),
      '--configs', 'dmc_proprio', 'debug', '--task', 'dmc_cartpole_balance',
      '--env.dmc.repeat', '10',  # 100-step episodes
      '--run.envs', '1', '--run.eval_envs', '1', '--run.eval_every', '2',
      '--run.steps', '1e9',
      '--logger.video_every', '1'], log)  # A train episode's frames would show.
  try:
    # The eval worker's first video, and a trained update; then SIGTERM.
    runs.wait_until(
        lambda: proc.poll() is not None or list(
            logdir.glob('videos/eval_video_*.gif')) and any(
            m.get('train/updates', 0) >= 1 and m['step'] >= 200
            for m in runs.metrics(logdir)),
        300, 'an eval video and an update (or the end of the run)', log)
  finally:
    code = runs.stop(proc)
  out = log.read_text()
  assert code == 0, out[-3000:]
  counters = json.loads((logdir / 'ckpt' / 'counters.json').read_text())
  # What the wait above saw, stored by the stop.
  assert counters['steps'] >= 200 and counters['version'] >= 1, counters
  files = sorted(p.name for p in logdir.rglob('*'))
  # Neither train nor actor-served eval episodes carry frames.
  assert not list(logdir.glob('videos/*episode_log_image_*.gif')), files
  videos = sorted((logdir / 'videos').glob('eval_video_*.gif'))
  assert videos, (files, out[-3000:])
  with Image.open(videos[0]) as gif:
    # The reset frame and the 100 steps; Pillow may merge equal frames.
    assert gif.size == (64, 64) and 50 <= gif.n_frames <= 101, (
        gif.size, gif.n_frames)


def _recipe(logdir, ports):
  """The multi-host commands of launch/README.md, as written, for this
  machine's loopback: (script flags per host, the FLAGS they share)."""
  text = (ROOT / 'launch' / 'README.md').read_text()
  block = text.split('On several hosts')[1].split('```')[1]
  lines = [line.strip().rstrip('&').strip() for line in block.splitlines()]
  shell = dict(line.split('=', 1) for line in lines
               if '=' in line.split(' ')[0] and not line.startswith('#'))
  shell = {k: v.strip('"') for k, v in shell.items()}
  for key in ('A', 'R'):
    shell['FLAGS'] = shell['FLAGS'].replace(f'${key}', '127.0.0.1')
  flags = shell['FLAGS'].replace('/shared/run1', str(logdir))
  for old, new in zip(('7001', '7002', '7003'), ports):
    flags = flags.replace(f':{old}', f':{new}')
  commands = [line.split('python -m dreamer_ver.main ')[1]
              .replace('$FLAGS', flags) for line in lines
              if line.startswith('python -m dreamer_ver.main')]
  return [shlex.split(command) for command in commands]


def test_the_multi_host_recipe_runs_as_written_on_loopback(tmp_path):
  """Two env fleets with their own id offsets, eval envs on one of them,
  all served by one agent: every env id's episodes arrive, train and eval
  ids never collide, and no carry is refused."""
  from dreamer_ver.rpc.addresses import free_port
  logdir = tmp_path / 'run'
  commands = _recipe(logdir, [free_port() for _ in range(3)])
  assert [c[1] for c in commands] == [
      'parallel_logger', 'parallel_agent', 'parallel_replay',
      'parallel_envs', 'parallel_envs']
  # A small task instead of dm_control; 4 envs per process keeps the
  # process count down (ids and capacities stay as written).
  test_flags = ['--configs', 'debug', '--task', 'synthetic_bandit',
                '--env.synthetic.length', '10', '--run.envs_per_worker', '4',
                '--run.log_every', '2', '--run.save_every', '5',
                '--run.steps', '1500']
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'PYTHONUNBUFFERED': '1'}
  procs = []
  try:
    for i, command in enumerate(commands):
      # The recipe's `--configs dmc_proprio` is replaced: the last value
      # of a flag wins, so the test's configs come after it.
      with open(tmp_path / f'{i}-{command[1]}.log', 'w') as log:
        procs.append(subprocess.Popen(
            [sys.executable, '-m', 'dreamer_ver.main', *command,
             *test_flags], cwd=ROOT, env=env, stdout=log,
            stderr=subprocess.STDOUT))
    agent = procs[1]
    code = agent.wait(timeout=420)
    out = (tmp_path / '1-parallel_agent.log').read_text()
    assert code == 0, out[-3000:]
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.terminate()
    for proc in procs:
      try:
        proc.wait(timeout=60)
      except subprocess.TimeoutExpired:
        proc.kill()
  scores = [json.loads(line) for line in
            (logdir / 'scores.jsonl').read_text().splitlines()]
  train = {s['env'] for s in scores if not s['eval']}
  evals = {s['env'] for s in scores if s['eval']}
  # As the recipe says: host C train 0-15 and eval 16-19, host D 20-35.
  assert train == set(range(16)) | set(range(20, 36)), sorted(train)
  assert evals == set(range(16, 20)), sorted(evals)
  metrics = [json.loads(line) for line in
             (logdir / 'metrics.jsonl').read_text().splitlines()]
  refused = [m['actor/carry_refused'] for m in metrics
             if 'actor/carry_refused' in m]
  assert all(count == 0 for count in refused), refused
  # The agent's metric rows may all be dropped in so short a run (metrics
  # never wait for a busy logger); a refused env gets CarryFull's error
  # in its reply, which ends its fleet with that message in its log.
  for log in tmp_path.glob('*.log'):
    assert 'needs a carry slot' not in log.read_text(), log.name
  assert not runs.children_alive(logdir)


def test_two_policy_lanes_and_two_train_devices_keep_each_envs_carry(
    tmp_path):
  """Two policy devices (a lane each, two batch threads per lane) and a
  learner data-parallel over two devices, as a user runs them. Every env's
  stored latents form one unbroken recurrence: the actor's RSSM step on
  row t started from that env's own latent and action of row t - 1
  (checked by recomputing the deterministic part of the step with the
  params that acted; version 0 = the initial params of the seed)."""
  import jax
  import numpy as np
  from dreamer_ver.agent.agent import Agent
  from dreamer_ver.agent import rssm
  from dreamer_ver.envs import make_env
  from dreamer_ver.replay.chunk import Chunk
  logdir = tmp_path / 'lanes'
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'PYTHONUNBUFFERED': '1',
         'XLA_FLAGS': '--xla_force_host_platform_device_count=2'}
  args = ['--script', 'parallel', '--logdir', str(logdir), '--run.steps', '300',
          *FLAGS, '--run.envs', '4', '--run.eval_envs', '0',
          '--jax.policy_devices', '0', '1', '--jax.train_devices', '0', '1',
          '--run.actor_threads', '2', '--replay_context', '0']
  proc = subprocess.run(
      [sys.executable, '-m', 'dreamer_ver.main', *args], cwd=ROOT, env=env,
      capture_output=True, text=True, timeout=300)
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0, out[-3000:]
  assert 'Policy compiled on cpu:1' in out, out[-3000:]
  # No part failed and restarted (a restarted actor starts fresh carries).
  assert 'restarting in' not in out and 'Agent failed' not in out, out[-3000:]
  counters = json.loads((logdir / 'ckpt' / 'counters.json').read_text())
  assert counters['version'] >= 1, counters  # The learner trained.

  chunks = [Chunk.load(path) for path in (logdir / 'replay').glob('*.npz')]
  by_uuid = {chunk.uuid: chunk for chunk in chunks}
  heads = set(by_uuid) - {chunk.succ for chunk in chunks}
  config = config_module.load_config(args)
  task = make_env(config.task, config.env)
  agent = Agent(task.obs_space, task.act_space, config)
  params = agent.init_params(config.seed)['dyn']
  core = jax.jit(lambda d, s, a: agent.dyn.apply(
      {'params': params}, d, s, rssm.embed_action(agent.act_space, a),
      method=agent.dyn.core))
  checked = 0
  assert len(heads) == 4  # one stream per env
  for head in heads:
    rows, uuid = [], head
    while uuid in by_uuid:
      rows.append(by_uuid[uuid].snapshot())
      uuid = by_uuid[uuid].succ
    stream = {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}
    steps = np.flatnonzero(
        ~stream['is_first'][1:] & (stream['version'][1:] == 0)) + 1
    prev = steps - 1
    expected = core(stream['dyn/deter'][prev], stream['dyn/stoch'][prev],
                    {k: stream[k][prev] for k in agent.act_space})
    np.testing.assert_allclose(
        stream['dyn/deter'][steps], expected, rtol=1e-4, atol=1e-5)
    checked += len(steps)
  assert checked >= 40, checked


def test_parallel_runs_a_crafter_debug_job(tmp_path):
  """The tiny debug model on 64x64 crafter frames through every process.
  Episodes are cut at 25 steps so that some finish; no eval env, which
  saves a process and a policy bucket (about 50 s on 2 busy cores, mostly
  start-up and the learner's compile). 600 steps: the envs act while the
  learner compiles, up to the debug limiter's allowance before the first
  sample (about 212 steps) plus the actor's shipments in flight, so 300
  could end before an update; 600 cannot without about 30 trained batches."""
  pytest.importorskip('crafter')
  logdir = tmp_path / 'crafter'
  code, out = _main(
      '--script', 'parallel', '--configs', 'debug', '--task', 'crafter_reward',
      '--logdir', str(logdir), '--run.steps', '600', '--run.envs', '2',
      '--run.eval_envs', '0', '--env.crafter.length', '25',
      '--run.log_every', '2')
  assert code == 0, out[-3000:]
  scores = [json.loads(line) for line in (logdir / 'scores.jsonl').open()]
  assert scores and all(s['length'] == 25 for s in scores)
  for score in scores:
    achievements = [k for k in score if k.startswith('log/achievement_')]
    # 22: crafter.constants.achievements
    assert len(achievements) == 22 and 'log/reward' in score
    assert all(score[k] >= 0 for k in achievements)
  metrics = [json.loads(line) for line in (logdir / 'metrics.jsonl').open()]
  assert 'episode/score' in set().union(*metrics)
  # The learner trained on the frames (its losses may miss the last write).
  counters = json.loads((logdir / 'ckpt' / 'counters.json').read_text())
  assert counters['steps'] >= 600 and counters['version'] >= 1, counters
