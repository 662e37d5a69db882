"""The replay server process: ``serve_replay(config)`` exposes the replay
service (``replay/service.py``) over portal's protocol (``rpc/server.py``; one
worker per method, so a blocked ``add_batch`` never blocks sampling), saves
periodically and sends stats to the logger without ever waiting on it.
"""

import contextlib

from dreamer_ver.core.atomic import StorageFault
from dreamer_ver.cluster.links import Links
from dreamer_ver.cluster.signals import StopSignal, run_periodically
from dreamer_ver.cluster.supervisor import USER_ERROR, stop_for_storage
from dreamer_ver.replay.service import METHODS, Closing, ReplayService
from dreamer_ver.rpc.server import Server

POLL = 0.5  # seconds between checks for a storage fault


def serve_replay(config, stop=None):
  """Process entry point: serve until SIGINT/SIGTERM (or ``stop``), save,
  exit 0. After a full or read-only disk it refuses new rows, says so in
  one line, has its supervisor stop the run in order (`end_run`), serves
  samples until its own stop, and exits `USER_ERROR`."""
  stop = stop if stop is not None else StopSignal()
  service = ReplayService.of(config)
  loaded = service.load()
  print(
      f'[replay] loaded {loaded["items"]} train and {loaded["eval_items"]} '
      f'eval sequences and {loaded["logged_rows"]} logged rows from '
      f'{service.logdir}', flush=True)
  links = Links.of(config)
  server = Server(links.addresses['replay'], 'Replay', quiet=(Closing, StorageFault),
                  **links.server_kwargs())
  for name in METHODS:
    server.bind(name, getattr(service, name), workers=1)
  server.start()
  logger = links.connect('logger', 'ReplayLogger', maxinflight=1,
                         when_full='drop')
  saved_activity = [service.activity]

  def save():
    if service.activity == saved_activity[0]:
      return  # Nothing new since the last save.
    saved_activity[0] = service.activity
    try:
      service.save()
    except StorageFault:
      pass  # said by `check` below
    except Exception as error:  # keep serving: the next save may succeed
      print(f'[replay] save failed: {error!r}', flush=True)

  def log():
    stats = service.stats()
    stats.update(_prefix(server.stats(), 'server/replay'))
    logger.add(stats)

  def check():
    """After a storage fault: one line, then the run stops in order (its
    supervisor stops the agent first, which still samples, then us)."""
    if service.fault is not None and not said:
      said.append(True)
      stop_for_storage('replay', service.fault, stop)
  said = []

  try:
    run_periodically(stop, [(config.run.save_every, save),
                            (config.run.log_every, log), (POLL, check)],
                     servers=[server])
  finally:
    print('[replay] stopping: saving', flush=True)
    service.interrupt()
    server.close(timeout=5)
    with contextlib.suppress(StorageFault):
      service.save()
    service.close()
    logger.close(timeout=1)
  if service.fault is not None:
    # What was acknowledged is in the write-ahead log, which only a
    # finished save drops: the next start recovers it.
    check()
    return USER_ERROR
  print('[replay] stopped', flush=True)
  return 0


# ------------------------------------------------------------------ helpers

def _prefix(mapping, prefix):
  return {f'{prefix}/{key}': value for key, value in mapping.items()}
