"""The logger server process: ``serve_logger(config)`` exposes the logger
service (``logger/service.py``) over portal's protocol; its methods share one
server worker (``rpc/server.py``), so they run one at a time, and the main
loop writes and saves on its clocks. ``tran`` is ``transitions`` under
upstream DreamerV3's name, so an unmodified upstream actor logs here too.
"""

import threading

from dreamer_ver.core.atomic import StorageFault, storage_fault
from dreamer_ver.cluster.links import Links
from dreamer_ver.cluster.signals import StopSignal, run_periodically
from dreamer_ver.cluster.supervisor import USER_ERROR, stop_for_storage
from dreamer_ver.logger.service import LoggerService
from dreamer_ver.rpc.server import Server


def serve_logger(config, stop=None):
  """Process entry point: serve until SIGINT/SIGTERM (or ``stop``), write,
  save, exit 0; after a full or read-only disk, say so in one line, stop
  the run in order and exit `USER_ERROR`."""
  stop = stop if stop is not None else StopSignal()
  service = LoggerService.of(config)
  if service.load():
    print(f'[logger] resumed at step {service.step}', flush=True)
  links = Links.of(config)
  faults = []  # the first StorageFault: said once; no later write is tried
  said = threading.Lock()  # `met` runs in the server's worker and here

  def met(error):
    """The StorageFault that `error` is, else None; the first is said in
    one line and stops the run in order (the logger serves on meanwhile)."""
    fault = storage_fault(error, config.logdir)
    with said:
      first = fault is not None and not faults
      if first:
        faults.append(fault)
    if first:
      step = service.step
      stop_for_storage('logger', f'{fault}; env step {step:_} was not saved',
                       stop, step=step)
    return fault

  def guarded(write):
    """`write`, unless the disk failed."""
    def call():
      if faults:
        return
      try:
        write()
      except Exception as error:
        if met(error) is None:
          raise
    return call

  def transitions(trans):
    """The service's; after a full or read-only disk, the caller's
    StorageFault, said here once (`met`), not once per batch. The batch
    that met it stays counted up to the episode whose line was refused:
    nothing is saved after the fault, so the next life resumes from the
    last save."""
    if faults:
      raise StorageFault(str(faults[0]))
    try:
      return service.transitions(trans)
    except Exception as error:
      fault = met(error)
      if fault is None:
        raise
      raise fault  # Its cause is `error`.

  server = Server(links.addresses['logger'], 'Logger', workers=1,
                  quiet=(StorageFault,), **links.server_kwargs())
  server.bind('add', service.add)  # All on the shared single worker.
  server.bind('transitions', transitions)
  server.bind('tran', transitions)  # upstream DreamerV3's actor
  server.start()
  reported_activity = [service.activity]

  def log():
    if service.activity != reported_activity[0]:  # Idle: nothing to report.
      service.add({f'server/logger/{key}': value
                   for key, value in server.stats().items()})
      reported_activity[0] = service.activity
    service.write()

  try:
    run_periodically(stop, [(config.run.log_every, guarded(log)),
                            (config.run.save_every, guarded(service.save))],
                     servers=[server])
  finally:
    server.close(timeout=5)
    guarded(service.write)()
    guarded(service.save)()
    service.close()
  if faults:
    return USER_ERROR
  print('[logger] stopped', flush=True)
  return 0
