"""The logger server process: ``serve_logger(config)`` exposes the logger
service (``service.py``) over portal's protocol; its methods share one
server worker (``rpc/server.py``), so they run one at a time, and the main
loop writes and saves on its clocks. ``tran`` is ``transitions`` under
upstream DreamerV3's name, so an unmodified upstream actor logs here too.
"""

from dreamer_ver.cluster.links import Links
from dreamer_ver.cluster.signals import StopSignal, run_periodically
from dreamer_ver.logger.service import LoggerService
from dreamer_ver.rpc.server import Server


def serve_logger(config, stop=None):
  """Process entry point: serve until SIGINT/SIGTERM (or ``stop``), write, save, exit 0."""
  stop = stop if stop is not None else StopSignal()
  service = LoggerService.of(config)
  if service.load():
    print(f'[logger] resumed at step {service.step}', flush=True)
  links = Links.of(config)
  server = Server(links.addresses['logger'], 'Logger', workers=1,
                  **links.server_kwargs())
  server.bind('add', service.add)  # All on the shared single worker.
  server.bind('transitions', service.transitions)
  server.bind('tran', service.transitions)  # upstream DreamerV3's actor
  server.start()
  reported_activity = [service.activity]

  def log():
    if service.activity != reported_activity[0]:  # Idle: nothing to report.
      service.add({f'server/logger/{key}': value
                   for key, value in server.stats().items()})
      reported_activity[0] = service.activity
    service.write()

  try:
    run_periodically(stop, [(config.run.log_every, log),
                            (config.run.save_every, service.save)],
                     servers=[server])
  finally:
    server.close(timeout=5)
    service.write()
    service.save()
    service.close()
  print('[logger] stopped', flush=True)
  return 0
