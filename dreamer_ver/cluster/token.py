"""The run token: the shared secret in every connection's handshake.

It comes from `run.token`, else the DREAMER_VER_TOKEN environment variable,
else `logdir/token` (created with owner-only permissions by the first
component that needs it).
"""

import os
import secrets
import sys
from pathlib import Path

from dreamer_ver.core.atomic import storage_fault
from dreamer_ver.config.validation import ConfigError

TOKEN_ENV = 'DREAMER_VER_TOKEN'


def with_token(config):
  """The config with `run.token` filled in (see the module docstring).
  Raises ConfigError for an empty or blank token: portal's handshake
  without one is public, so it would let anyone in."""
  if config.run.token:
    token, where = config.run.token, 'run.token'
  elif os.environ.get(TOKEN_ENV):
    token, where = os.environ[TOKEN_ENV], TOKEN_ENV
  else:
    path = Path(config.logdir) / 'token'
    token, where = _logdir_token(Path(config.logdir)), str(path)
  if not token.strip():
    raise ConfigError(
        f'{where} is empty: the run token must be a secret, not blank '
        '(remove an empty token file and one is made)')
  return config.update({'run.token': token})


def _logdir_token(logdir):
  """`logdir/token`, made if missing; a disk that cannot hold it or a
  token that is not text is a ConfigError (one line, exit code 2)."""
  path = logdir / 'token'
  if not path.exists():
    tmp = logdir / f'.token.{os.getpid()}'
    try:
      logdir.mkdir(parents=True, exist_ok=True)
      fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
      with os.fdopen(fd, 'w') as f:
        f.write(secrets.token_hex(16))
      os.link(tmp, path)  # Atomic: if another component won, keep theirs.
    except FileExistsError:
      pass
    except OSError as error:
      fault = storage_fault(error, tmp)
      if fault is None:
        raise
      raise ConfigError(f'{fault}: the run token cannot be made; free '
                        'space there (or make it writable)') from None
    finally:
      tmp.unlink(missing_ok=True)
  if path.stat().st_mode & 0o077:
    print(f'warning: other users can read the run token in {path}; '
          f'chmod 600 {path}', file=sys.stderr)
  try:
    return path.read_bytes().decode('ascii').strip()
  except UnicodeDecodeError:
    raise ConfigError(
        f'the run token in {path} is not text (a damaged copy?): remove it '
        'and one is made (every component of the run must then be '
        'restarted with the new one)') from None
