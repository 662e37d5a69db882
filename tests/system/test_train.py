"""`--script train`: the single-process loop runs to its steps, trains,
checkpoints in the parallel runtime's format, and resumes."""

import json
import signal

from dreamer_ver import main as mainlib
from dreamer_ver.agent import checkpoint

FLAGS = ['--configs', 'debug', '--task', 'synthetic_bandit',
         '--env.synthetic.length', '10', '--run.train_ratio', '16']


def test_train_runs_checkpoints_and_resumes(tmp_path, capsys, monkeypatch):
  logdir = tmp_path / 'run'
  flags = ['--script', 'train', '--logdir', str(logdir), *FLAGS]
  handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
  saves = []
  real = checkpoint.Checkpoint.save
  monkeypatch.setattr(checkpoint.Checkpoint, 'save', lambda self, *a: (
      saves.append(1), real(self, *a))[1])
  # run.save_every <= 0: no periodic saves (as in the replay and logger
  # servers), only the one at the end.
  assert mainlib.main([*flags, '--run.steps', '200',
                       '--run.save_every', '0']) in (0, None)
  assert len(saves) == 1
  # It stops on SIGINT/SIGTERM while it runs, and gives them back after.
  assert (signal.getsignal(signal.SIGINT),
          signal.getsignal(signal.SIGTERM)) == handlers
  counters = json.loads((logdir / 'ckpt' / 'counters.json').read_text())
  # 200 steps, 4 envs: updates start once replay holds a batch (8 x 10).
  assert counters['steps'] == 200 and counters['version'] > 0, counters
  scores = [json.loads(line) for line in (logdir / 'scores.jsonl').open()]
  # Each env steps 50 times; an episode takes its 10 steps plus the reset
  # step, so every env finished 4 episodes.
  assert len(scores) == 4 * (50 // 11)
  assert all(s['length'] == 10 for s in scores)
  assert all(s['eval'] is False for s in scores)  # As the parallel runtime.

  assert mainlib.main([*flags, '--run.steps', '300']) in (0, None)
  assert 'Agent resumed at step 200 ' in capsys.readouterr().out
  resumed = json.loads((logdir / 'ckpt' / 'counters.json').read_text())
  assert resumed['steps'] == 300 and resumed['version'] > counters['version']


def test_train_samples_with_the_configured_selector(tmp_path, monkeypatch):
  """`train` builds its replay as the replay server does (replay.fracs)."""
  from dreamer_ver.replay import Recency, build
  built = []
  real = build.train_replay
  monkeypatch.setattr(build, 'train_replay', lambda *a: built.append(
      real(*a)) or built[-1])
  assert mainlib.main([
      '--script', 'train', '--logdir', str(tmp_path), *FLAGS,
      '--run.steps', '200', '--replay.fracs.uniform', '0',
      '--replay.fracs.recency', '1']) in (0, None)
  replay, = built
  assert isinstance(replay.selector, Recency)
  assert replay.stats()['samples'] > 0


def test_train_warm_starts_and_stops_at_its_duration(tmp_path, capsys):
  source = tmp_path / 'source'
  assert mainlib.main([
      '--script', 'train', '--logdir', str(source), *FLAGS,
      '--run.steps', '200']) in (0, None)
  trained = json.loads((source / 'ckpt' / 'counters.json').read_text())
  capsys.readouterr()
  warm = tmp_path / 'warm'
  assert mainlib.main([
      '--script', 'train', '--logdir', str(warm), *FLAGS,
      '--run.steps', '1e9', '--run.duration', '3',
      '--run.from_checkpoint', str(source)]) in (0, None)
  assert f'Warm start from {source / "ckpt"}' in capsys.readouterr().out
  counters = json.loads((warm / 'ckpt' / 'counters.json').read_text())
  # Fresh counters, stopped by the wall clock long before run.steps.
  assert 0 < counters['steps'] < 1e9 and counters != trained

