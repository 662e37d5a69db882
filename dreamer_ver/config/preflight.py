"""Checks that a run can start, made once in the process the user started,
before anything is spawned: a mistake there is one line and exit code 2
(`main.py`), not a child in a restart loop printing the same traceback.

  check(config, task=True, outputs=True, platform=True)
      raises ConfigError naming the first problem; the flags say what the
      script runs on this host (main.py's PREFLIGHT)

* the logdir is a folder (or can be one) that this process may write in;
* the task builds: one train env (and one eval env) is made and closed; a
  suite whose package is missing names the extra that installs it;
* every logger output can start: its package is installed, and W&B has a
  login or runs offline;
* the JAX platform asked for (`jax.platform`) exists, checked in a child
  process so this one never loads JAX.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from dreamer_ver.config.validation import ConfigError

# A suite's extra, by the module whose absence means it is not installed.
EXTRAS = {'dm_control': 'dmc', 'mujoco': 'dmc', 'labmaze': 'dmc',
          'ale_py': 'atari', 'crafter': 'crafter', 'pygame': 'gym',
          'memory_maze': 'memmaze', 'gym': 'memmaze'}
PLATFORM_SECONDS = 120  # a first JAX import on a cold machine


def check(config, task=True, outputs=True, platform=True):
  """See the module docstring."""
  _check_logdir(config.logdir)
  if task:
    _check_task(config)
  if outputs:
    _check_outputs(config)
  if platform:
    _check_platform(config.jax.platform)


def _check_logdir(logdir):
  path = Path(logdir).expanduser()
  for folder in (path, *path.parents):
    if folder.exists():
      if not folder.is_dir():
        raise ConfigError(f'logdir {path}: {folder} is a file, not a folder')
      if not os.access(folder, os.W_OK | os.X_OK):  # EROFS counts, for root
        raise ConfigError(
            f'logdir {path}: {folder} cannot be written (a read-only file '
            'system, or no permission): choose another --logdir, or copy it '
            'to one that can')
      break


def _check_task(config):
  from dreamer_ver.envs import make_run_env
  ids = [0] + ([config.run.envs] if config.run.eval_envs else [])
  for envid in ids:
    try:
      make_run_env(config, envid).close()
    except ModuleNotFoundError as e:
      extra = EXTRAS.get((e.name or '').split('.')[0])
      hint = (f": pip install 'dreamer_ver[{extra}]'" if extra else '')
      raise ConfigError(
          f'task {config.task} needs the {e.name} package{hint}') from None
    except Exception as e:
      raise ConfigError(
          f'task {config.task}: {type(e).__name__}: {e}') from None


def _check_outputs(config):
  from dreamer_ver.logger.outputs import missing
  problem = missing(config)
  if problem:
    raise ConfigError(problem)
  if 'wandb' in config.logger.outputs and not _wandb_ready(
      config.logger.wandb_mode):
    raise ConfigError(
        "logger.outputs has 'wandb', but W&B has no login here: run "
        '`wandb login`, set WANDB_API_KEY, or --logger.wandb_mode offline')


def _wandb_ready(mode):
  offline = ('offline', 'disabled', 'dryrun')
  if mode in offline or os.environ.get('WANDB_MODE') in offline:
    return True
  if os.environ.get('WANDB_API_KEY'):
    return True
  netrc = Path(os.environ.get('NETRC', Path.home() / '.netrc'))
  return netrc.is_file() and 'api.wandb.ai' in netrc.read_text(
      errors='replace')


def _check_platform(platform):
  if platform in ('', 'cpu') or importlib.util.find_spec('jax') is None:
    return
  name = 'cuda' if platform == 'gpu' else platform
  try:
    result = subprocess.run(
        [sys.executable, '-c', f'import jax; jax.devices({name!r})'],
        capture_output=True, text=True, timeout=PLATFORM_SECONDS)
  except subprocess.TimeoutExpired:
    return  # Slow, not absent: the run finds out itself.
  if result.returncode:
    hint = (" (pip install 'dreamer_ver[cuda]' for NVIDIA GPUs)"
            if name == 'cuda' else '')
    raise ConfigError(
        f'jax.platform {platform}: JAX has no {name} backend on this '
        f'machine{hint}')
