"""The replay server process: ``serve_replay(config)`` exposes the replay
service (``service.py``) over portal's protocol (``rpc/server.py``; one
worker per method, so a blocked ``add_batch`` never blocks sampling), saves
periodically and sends stats to the logger without ever waiting on it.
"""

from dreamer_ver.cluster.links import Links
from dreamer_ver.cluster.signals import StopSignal, run_periodically
from dreamer_ver.replay.service import METHODS, Closing, ReplayService
from dreamer_ver.rpc.server import Server


def serve_replay(config, stop=None):
  """Process entry point: serve until SIGINT/SIGTERM (or ``stop``), save, exit 0."""
  stop = stop if stop is not None else StopSignal()
  service = ReplayService.of(config)
  loaded = service.load()
  print(
      f'[replay] loaded {loaded["items"]} train and {loaded["eval_items"]} '
      f'eval sequences and {loaded["logged_rows"]} logged rows from '
      f'{service.logdir}', flush=True)
  links = Links.of(config)
  server = Server(links.addresses['replay'], 'Replay', quiet=(Closing,),
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
    except Exception as error:  # E.g. a full disk: keep serving.
      print(f'[replay] save failed: {error!r}', flush=True)

  def log():
    stats = service.stats()
    stats.update(_prefix(server.stats(), 'server/replay'))
    logger.add(stats)

  try:
    run_periodically(stop, [(config.run.save_every, save),
                            (config.run.log_every, log)], servers=[server])
  finally:
    print('[replay] stopping: saving', flush=True)
    service.interrupt()
    server.close(timeout=5)
    service.save()
    service.close()
    logger.close(timeout=1)
  print('[replay] stopped', flush=True)
  return 0


# ------------------------------------------------------------------ helpers

def _prefix(mapping, prefix):
  return {f'{prefix}/{key}': value for key, value in mapping.items()}
