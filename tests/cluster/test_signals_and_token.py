"""The graceful stop and periodic loop (cluster/signals.py) and the run
token (cluster/token.py)."""

import os
import signal
import threading
import time

import pytest

from dreamer_ver.config.loading import ConfigError, compose
from dreamer_ver.cluster.signals import StopSignal, run_periodically
from dreamer_ver.cluster.token import TOKEN_ENV, with_token
from helpers.storage import refuse


def test_run_periodically_calls_each_task_at_its_interval_until_stopped():
  stop = StopSignal(install=False)
  calls = {'fast': [], 'slow': [], 'never': []}
  tasks = [(0.05, lambda: calls['fast'].append(time.monotonic())),
           (0.3, lambda: calls['slow'].append(time.monotonic())),
           (0, lambda: calls['never'].append(time.monotonic()))]
  start = time.monotonic()  # Before the timer: at least 1 s then.
  threading.Timer(1.0, stop.set).start()
  run_periodically(stop, tasks, poll=0.01)
  elapsed = time.monotonic() - start
  assert 1.0 <= elapsed < 3.0
  assert calls['never'] == []
  # At 0.3, 0.6, 0.9 s, late at worst (a loaded machine fires the stop's
  # timer late too: then one more); never sooner than 0.3 s apart (the
  # clocks count wall time, this test monotonic time: 1 ms of slack).
  slow = [start] + calls['slow']
  gaps = [b - a for a, b in zip(slow, slow[1:])]
  assert 3 <= len(slow) <= elapsed / 0.299 + 1, (elapsed, gaps)
  assert all(gap >= 0.299 for gap in gaps), gaps
  assert len(calls['fast']) >= 8


def test_a_stop_signal_is_set_by_sigterm_and_restores_the_handlers_it_replaced():
  before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
  stop = StopSignal()
  try:
    assert not stop
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.wait(5)
  finally:
    stop.restore()
  assert (signal.getsignal(signal.SIGINT),
          signal.getsignal(signal.SIGTERM)) == before


NESTED = """
import os, signal, sys
from dreamer_ver.cluster.signals import StopSignal
stop = StopSignal()
outer = []

def again(frame, event, arg):
  # At every line the first handler runs (a line of its own or of what it
  # calls), the second signal arrives: its handler runs inside the first.
  if event == 'call' and frame.f_code is StopSignal._handle.__code__:
    if outer:
      return None
    outer.append(frame)
  if outer and outer[0] is not None and event in ('call', 'line'):
    os.kill(os.getpid(), signal.SIGINT)
  if event == 'return' and outer and frame is outer[0]:
    outer[0] = None  # The first handler is done.
  return again

sys.settrace(again)
os.kill(os.getpid(), signal.SIGTERM)
for _ in range(100):
  pass
sys.settrace(None)
print('stopped' if stop.wait(10) else 'not stopped', flush=True)
"""


def test_a_signal_that_lands_inside_the_handler_of_another_does_not_hang():
  """SIGINT and SIGTERM together (Ctrl-C and `timeout`, or a scheduler that
  signals every process) run one handler inside the other: a handler that
  took a lock (Event.set) would wait for good for the one it interrupted."""
  import subprocess
  import sys
  try:
    done = subprocess.run([sys.executable, '-c', NESTED], capture_output=True,
                          text=True, timeout=30, check=False)
  except subprocess.TimeoutExpired:
    raise AssertionError('the process hung in its signal handlers') from None
  assert done.stdout.strip() == 'stopped', done.stdout + done.stderr


def test_the_token_comes_from_the_flag_the_environment_or_the_logdir(
    tmp_path, monkeypatch):
  monkeypatch.delenv(TOKEN_ENV, raising=False)
  config = compose(['debug'], {'logdir': str(tmp_path)})
  made = with_token(config).run.token
  assert len(made) == 32 and (tmp_path / 'token').read_text() == made
  assert (tmp_path / 'token').stat().st_mode & 0o777 == 0o600
  assert with_token(config).run.token == made  # The same file, again.
  monkeypatch.setenv(TOKEN_ENV, 'from-env')
  assert with_token(config).run.token == 'from-env'
  assert with_token(config.update({'run.token': 'flag'})).run.token == 'flag'


def test_an_empty_token_is_refused_not_taken_for_no_authentication(
    tmp_path, monkeypatch):
  # portal's default handshake is public: an empty token would mean any
  # local or remote client gets in.
  monkeypatch.delenv(TOKEN_ENV, raising=False)
  config = compose(['debug'], {'logdir': str(tmp_path)})
  (tmp_path / 'token').write_text(' \n')
  (tmp_path / 'token').chmod(0o600)
  with pytest.raises(ConfigError, match='token.*empty'):
    with_token(config)
  with pytest.raises(ConfigError, match='run.token.*empty'):
    with_token(config.update({'run.token': '   '}))
  monkeypatch.setenv(TOKEN_ENV, ' ')
  with pytest.raises(ConfigError, match=f'{TOKEN_ENV}.*empty'):
    with_token(config)


def test_a_damaged_token_or_a_full_disk_is_one_line_not_a_traceback(
    tmp_path, monkeypatch):
  monkeypatch.delenv(TOKEN_ENV, raising=False)
  config = compose(['debug'], {'logdir': str(tmp_path)})
  path = tmp_path / 'token'
  path.write_bytes(b'3f\xa9c')  # a flipped byte
  path.chmod(0o600)
  with pytest.raises(ConfigError, match=(
      rf'^the run token in {path} is not text \(a damaged copy\?\): remove '
      'it and one is made')):
    with_token(config)
  path.unlink()
  monkeypatch.setattr(os, 'open', lambda path, *_: refuse(path))  # full
  with pytest.raises(ConfigError, match=(
      rf'^no space left on device writing {tmp_path}/\.token\.\d+ \(.* MB '
      r'free of .*\): the run token cannot be made')):
    with_token(config)
  monkeypatch.undo()
  assert list(tmp_path.iterdir()) == []  # nothing left behind


def test_a_token_file_others_can_read_gets_a_warning(tmp_path, monkeypatch,
                                                     capsys):
  monkeypatch.delenv(TOKEN_ENV, raising=False)
  config = compose(['debug'], {'logdir': str(tmp_path)})
  (tmp_path / 'token').write_text('abc123')
  (tmp_path / 'token').chmod(0o644)
  assert with_token(config).run.token == 'abc123'
  err = capsys.readouterr().err
  assert 'token' in err and 'chmod 600' in err and 'abc123' not in err


def test_a_server_that_stopped_serving_ends_the_main_loop_with_an_error():
  import types
  server = types.SimpleNamespace(name='Replay', error=None)
  stop = StopSignal(install=False)
  threading.Timer(0.2, lambda: setattr(
      server, 'error', OSError(24, 'Too many open files'))).start()
  threading.Timer(5.0, stop.set).start()  # Only if it never raises.
  start = time.monotonic()
  with pytest.raises(RuntimeError, match='Replay stopped serving.*open files'):
    run_periodically(stop, [], poll=0.01, servers=[server])
  assert time.monotonic() - start < 2.0
  stop.set()
