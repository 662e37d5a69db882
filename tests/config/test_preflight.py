"""A user's mistake at start is one line on stderr and exit code 2, before
anything is spawned (`dreamer_ver/config/preflight.py`, called by `main.py`), for
every script that would otherwise restart a child failing on it."""

import pytest

from dreamer_ver import main as mainlib
from dreamer_ver.config import preflight
from dreamer_ver.config.validation import ConfigError

SCRIPTS = ['parallel', 'train']


def run(capsys, *flags):
  code = mainlib.main(['--configs', 'debug', *flags])
  out = capsys.readouterr()
  return code, out.err.strip().splitlines(), out.out


@pytest.mark.parametrize('script', SCRIPTS)
def test_a_misspelt_task_is_one_line_with_the_suites_own_hint(
    script, tmp_path, capsys):
  code, err, out = run(capsys, '--script', script, '--logdir', str(tmp_path),
                       '--task', 'gym_CartPol-v1')
  assert code == 2 and 1 <= len(err) <= 3, err
  assert err[0].startswith('error: task gym_CartPol-v1:'), err
  assert 'Did you mean' in ' '.join(err) and 'CartPole' in ' '.join(err)
  assert out == ''  # Nothing else printed, nothing started.
  assert not (tmp_path / 'config.yaml').exists()


@pytest.mark.parametrize('script', SCRIPTS)
def test_a_logdir_that_is_a_file_is_one_line(script, tmp_path, capsys):
  path = tmp_path / 'afile'
  path.write_text('x')
  code, err, _ = run(capsys, '--script', script, '--logdir', str(path / 'run'),
                     '--task', 'dummy_disc')
  assert code == 2 and err == [
      f'error: logdir {path / "run"}: {path} is a file, not a folder'], err


@pytest.fixture
def read_only(tmp_path):
  """A folder no one may write in: a read-only tmpfs where this process may
  mount one (root, who may write anywhere else), else one without write
  permission."""
  import os
  import subprocess
  from helpers.storage import can_mount
  folder = tmp_path / 'ro'
  folder.mkdir()
  if os.geteuid() != 0:
    folder.chmod(0o555)
    yield folder
    folder.chmod(0o755)
    return
  if not can_mount():
    pytest.skip('root without the right to mount: it may write anywhere')
  subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=1m,ro', 'tmpfs',
                  str(folder)], check=True)
  try:
    yield folder
  finally:
    subprocess.run(['umount', str(folder)], check=True)


@pytest.mark.parametrize('script', SCRIPTS)
@pytest.mark.parametrize('exists', [False, True], ids=['new', 'copied'])
def test_a_logdir_that_cannot_be_written_is_one_line(
    script, exists, read_only, capsys):
  # A new run's logdir, or a finished run's copied to read-only media.
  logdir = read_only if exists else read_only / 'run'
  code, err, out = run(capsys, '--script', script, '--logdir', str(logdir),
                       '--task', 'dummy_disc')
  assert code == 2 and err == [
      f'error: logdir {logdir}: {read_only} cannot be written (a read-only '
      'file system, or no permission): choose another --logdir, or copy '
      'it to one that can'], err
  assert out == ''


@pytest.mark.parametrize('script', SCRIPTS)
def test_wandb_without_a_login_is_one_line(
    script, tmp_path, capsys, monkeypatch):
  pytest.importorskip('wandb')
  for key in ('WANDB_API_KEY', 'WANDB_MODE'):
    monkeypatch.delenv(key, raising=False)
  monkeypatch.setenv('NETRC', str(tmp_path / 'no_netrc'))
  code, err, _ = run(capsys, '--script', script, '--logdir', str(tmp_path),
                     '--task', 'dummy_disc', '--logger.outputs', 'jsonl',
                     'wandb')
  assert code == 2 and len(err) == 1 and 'wandb login' in err[0], err
  preflight.check(mainlib_config(tmp_path, [
      '--logger.outputs', 'wandb', '--logger.wandb_mode', 'offline']),
      task=False, platform=False)  # Offline: fine.


@pytest.mark.parametrize('script', SCRIPTS)
def test_a_jax_platform_this_machine_lacks_is_one_line(
    script, tmp_path, capsys):
  code, err, _ = run(capsys, '--script', script, '--logdir', str(tmp_path),
                     '--task', 'dummy_disc', '--jax.platform', 'tpu')
  assert code == 2 and err == [
      'error: jax.platform tpu: JAX has no tpu backend on this machine'], err


def test_a_missing_suite_package_names_its_extra(tmp_path, monkeypatch):
  import dreamer_ver.envs as envs

  def missing(*args, **kwargs):
    raise ModuleNotFoundError("No module named 'dm_control'",
                              name='dm_control')
  monkeypatch.setattr(envs, 'make_run_env', missing)
  with pytest.raises(ConfigError) as error:
    preflight.check(mainlib_config(tmp_path, ['--task', 'dmc_walker_walk']),
                    outputs=False, platform=False)
  assert str(error.value) == (
      "task dmc_walker_walk needs the dm_control package: "
      "pip install 'dreamer_ver[dmc]'")


def mainlib_config(tmp_path, flags):
  from dreamer_ver.config import loading as configlib
  return configlib.load_config(
      ['--configs', 'debug', '--logdir', str(tmp_path), *flags])
