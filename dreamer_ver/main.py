"""Command line entry point.

    dreamer-ver [--configs a b ...] [--script NAME] [--key.sub VALUE ...]
    python -m dreamer_ver.main ...   (the same)
    dreamer-ver --version

Builds the config (``configs/defaults.yaml``, then the named blocks in order,
then the flags), validates it, prints a short summary and calls the script
function registered under ``config.script`` with the config as its only
argument: ``fn(config)``, where ``config`` is an ``elements.Config`` whose
``logdir`` is already absolute. If the function returns an int, it becomes the
exit status.

From the command line, a process whose JAX runs on the CPU first starts
again with the allocator of `jax.malloc` preloaded (cluster/devices.py);
its children inherit it.

Bad input (unknown block, unknown key, wrong type, failed validation, script
not available) prints one line to stderr and exits with status 2.
``--help`` prints every key with its value after the given blocks and its
meaning (the key's comment in ``configs/defaults.yaml``).
"""

import os
import sys

from dreamer_ver.cluster.targets import load

# Script name -> 'module:function'. Modules are imported only when their
# script runs, so a script's heavy imports (JAX, env suites) never slow down
# or break the others.
SCRIPTS = {
    'train': 'dreamer_ver.scripts.train:train',
    'parallel': 'dreamer_ver.scripts.parallel:parallel',
    'ray': 'dreamer_ver.scripts.ray_cluster:ray_cluster',
    'parallel_env': 'dreamer_ver.scripts.parallel:parallel_env',
    'parallel_envs': 'dreamer_ver.scripts.parallel:parallel_envs',
    'parallel_replay': 'dreamer_ver.scripts.parallel:parallel_replay',
    'parallel_logger': 'dreamer_ver.scripts.parallel:parallel_logger',
    'parallel_agent': 'dreamer_ver.scripts.parallel:parallel_agent',
    'parallel_learner': 'dreamer_ver.scripts.parallel:parallel_learner',
    'eval_only': 'dreamer_ver.scripts.eval_only:eval_only',
}

# What each script runs on this host, so what `preflight` checks before it
# starts: the task's envs, the logger's outputs, JAX's platform.
PREFLIGHT = {
    'train': {}, 'parallel': {}, 'eval_only': dict(outputs=False),
    'parallel_env': dict(outputs=False, platform=False),
    'parallel_envs': dict(outputs=False, platform=False),
    'parallel_replay': dict(task=False, outputs=False, platform=False),
    'parallel_logger': dict(task=False, platform=False),
    'parallel_agent': dict(outputs=False),
    'parallel_learner': dict(outputs=False),
    'ray': dict(task=False, platform=False),
}

# Scripts that run only env processes or a multi-host run's other learners:
# they neither create the logdir nor write config.yaml into it (the host
# that owns the logdir does that).
NO_LOGDIR_SUFFIXES = ('_env', '_envs', '_learner')

USAGE = (
    'usage: python -m dreamer_ver.main [--configs BLOCK ...] '
    '[--script NAME] [--logdir DIR] [--key.sub VALUE ...]')


def _error(message):
  print(f'error: {message}', file=sys.stderr)
  return 2


def _available():
  return ', '.join(sorted(SCRIPTS)) or '(none registered yet)'


def _keys_help(config, meanings):
  """`key  value  # meaning` per key, aligned: what every key is set to
  and what it does, without opening defaults.yaml."""
  values = {k: _show(v) for k, v in config.flat.items()}
  width = max(map(len, values))
  vwidth = min(16, max(map(len, values.values())))
  lines = ['Keys (after the given blocks):  key  value  # meaning']
  for key, value in values.items():
    meaning = meanings.get(key, '')
    lines.append(f'  {key.ljust(width)}  {value.ljust(vwidth)}  # {meaning}')
  return '\n'.join(lines)


def _show(value):
  """A value as YAML would write it (lists in brackets, '' for empty)."""
  if isinstance(value, tuple):
    return '[' + ', '.join(map(_show, value)) + ']'
  return "''" if value == '' else str(value)


def main(argv=None):
  from dreamer_ver.config import loading as configlib

  command_line = argv is None
  argv = list(sys.argv[1:] if command_line else argv)
  if argv == ['--version']:
    from . import __version__
    print(f'dreamer_ver {__version__}')
    return 0
  if '--help' in argv or '-h' in argv:
    rest = [a for a in argv if a not in ('--help', '-h')]
    try:
      config, _ = configlib.parse_known(rest)
    except configlib.ConfigError as e:
      return _error(e)
    print(USAGE)
    print(f"blocks: {', '.join(configlib.block_names())}")
    print(f'scripts: {_available()}')
    print(_keys_help(configlib.redacted(config, '(hidden)'),
                     configlib.meanings()))
    return 0

  try:
    config = configlib.load_config(argv, check=False)
    if 'JOB_COMPLETION_INDEX' in os.environ:
      # Kubernetes indexed jobs: the job index is this process's replica.
      index = os.environ['JOB_COMPLETION_INDEX']
      if not index.strip().isdigit():
        raise configlib.ConfigError(
            f"JOB_COMPLETION_INDEX must be an int >= 0, got '{index}'")
      config = configlib.override(config, {'replica': int(index)})
    configlib.validate(config)
  except configlib.ConfigError as e:
    return _error(e)

  if config.script not in SCRIPTS:
    return _error(
        f"script '{config.script}' is not available; available scripts: "
        f'{_available()}')

  if command_line:  # before anything runs: JAX's allocator (jax.malloc)
    from .cluster import devices
    environ = devices.malloc_restart_env(
        config.jax.malloc, config.jax.platform, os.environ)
    if environ:
      os.execve(sys.executable, sys.orig_argv, environ)
  config = configlib.resolve_logdir(config)
  from dreamer_ver.config import preflight
  try:
    preflight.check(config, **PREFLIGHT.get(config.script, {}))
  except configlib.ConfigError as e:
    return _error(e)
  names, _, _ = configlib.split_argv(argv)
  print(configlib.summary(config, names), flush=True)

  fn = load(SCRIPTS[config.script])
  if not config.script.endswith(NO_LOGDIR_SUFFIXES):
    os.makedirs(config.logdir, exist_ok=True)
    configlib.redacted(config).save(os.path.join(config.logdir, 'config.yaml'))
  try:
    result = fn(config)
  except configlib.ConfigError as e:  # Found by a script as it starts.
    return _error(e)
  return result if isinstance(result, int) else 0


if __name__ == '__main__':
  sys.exit(main())
