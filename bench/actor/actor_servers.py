"""The servers the actor bench compares (bench/actor/actor_bench.py): the baseline
(portal's BatchServer with a fixed batch, as DreamerV3's actor) and ours,
the counter of what each served, and the replays `--wal` ships to."""

import multiprocessing
import os
import signal
import sys
import threading
import time

from bench.actor.actor_fleets import STARTUP_SECONDS

WAL_MODES = ('off', 'flush')  # the replays of --wal, by `replay.wal`
REPLAY_SIZE = 1e5  # --wal replays' capacity: bounds their memory


class Counter:
  """Rows served, by whom, and when the last batch was served."""

  def __init__(self):
    self.lock = threading.Lock()
    self.rows = 0
    self.batches = 0
    self.envids = set()
    self.last = time.monotonic()
    self.policy_seconds = 0.0

  def add(self, envids, seconds):
    with self.lock:
      self.rows += len(envids)
      self.batches += 1
      self.envids.update(int(e) for e in envids)
      self.last = time.monotonic()
      self.policy_seconds += seconds

  def snapshot(self):
    with self.lock:
      return self.rows, self.batches, self.policy_seconds


class Baseline:
  """DreamerV3's actor server: portal.BatchServer, exactly `batch` requests
  per call; its workfn gets the stacked requests and runs Actor.step."""

  def __init__(self, port, actor, batch, counter):
    import portal
    keys = list(actor.agent.act_space)

    def workfn(data):
      start = time.perf_counter()
      count = len(data['envid'])
      datas = [{k: v[i] for k, v in data.items()} for i in range(count)]
      trans = actor.step(datas)
      result = {k: trans[k] for k in keys}
      result['reset'] = trans['is_last']
      counter.add(trans['envid'], time.perf_counter() - start)
      return result

    self.server = _retry_bind(lambda: portal.BatchServer(
        port, 'Baseline', workers=1, process=True, logging=False))
    self.server.bind('act', workfn, batch=batch)
    self.server.start(block=False)

  def stats(self):
    return {}

  def child_pids(self):
    batcher = getattr(self.server, 'batcher', None)
    return [batcher.pid] if batcher is not None and batcher.pid else []

  def close(self):
    self.server.close(timeout=5)


class Ours:
  """Our BatchServer with the cutoff named by `mode`, from make_cutoff."""

  def __init__(self, addr, actor, config, envs, inference, counter, mode):
    from dreamer_ver.config import loading as configlib
    from dreamer_ver.actor import batching
    from dreamer_ver.rpc.batch_server import BatchServer
    from dreamer_ver.cluster.links import Links
    run = configlib.override(config, {'run.actor_cutoff': mode}).run
    self.cutoff = batching.make_cutoff(run, envs, actor.buckets, inference)

    def handler(requests):
      start = time.perf_counter()
      replies, context = actor.handle(requests)
      served = [r.envid for r, reply in zip(requests, replies)
                if not isinstance(reply, BaseException)]
      counter.add(served, time.perf_counter() - start)
      return replies, context

    kwargs = {**Links.of(config).server_kwargs(), 'logging': False}
    if hasattr(actor, 'max_request_bytes'):
      kwargs['max_msg_size'] = actor.max_request_bytes()
    transports = ('tcp', 'shm') if run.actor_transport == 'shm' else ('tcp',)
    self.server = _retry_bind(lambda: BatchServer(
        addr, handler, self.cutoff, postfn=actor.post,
        workers=run.actor_threads, name=f'Actor_{mode}',
        transports=transports, **kwargs))
    self.server.start()

  def stats(self):
    return self.server.stats()

  def child_pids(self):
    return []

  def close(self):
    self.server.close()


def die_with_parent():
  """Runs in portal's child processes: SIGKILL when the parent exits."""
  try:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
  except Exception:
    pass


def _retry_bind(make, seconds=15.0):
  """The previous server's socket may take a moment to release the port."""
  deadline = time.monotonic() + seconds
  while True:
    try:
      return make()
    except OSError:
      if time.monotonic() > deadline:
        raise
      time.sleep(0.2)


class Shipped:
  """The actor's link to a --wal replay: a futures client whose last
  add_batch is kept, so a window's shipping can drain before the next."""

  def __init__(self, client):
    self.client = client
    self.last = None

  def add_batch(self, trans):
    self.last = self.client.add_batch(trans)
    return self.last

  def close(self, timeout=30.0):
    # The replay answers add_batch calls in order: the last reply comes last.
    if self.last is not None:
      try:
        self.last.result(timeout)
      except Exception as error:
        print(f'  replay add_batch failed: {error!r}', flush=True)
    self.client.close(timeout=2)


def start_replays(config, outdir):
  """One replay server process per mode of WAL_MODES (--wal), on the
  fleet's config; returns {wal: (process, address)} once each answers."""
  from dreamer_ver.config import loading as configlib
  from dreamer_ver.rpc.addresses import free_port
  from dreamer_ver.rpc.client import Client
  context = multiprocessing.get_context('spawn')
  replays = {}
  for wal in WAL_MODES:
    replay_config = configlib.override(config, {
        'logdir': os.path.join(outdir, f'replay_{wal}'), 'replay.wal': wal,
        'replay.size': REPLAY_SIZE, 'run.train_ratio': 0.0,
        'run.replay_addr': f'127.0.0.1:{free_port()}',
        # Nobody listens: the replay's stats are dropped.
        'run.logger_addr': f'127.0.0.1:{free_port()}'})
    log = os.path.join(outdir, f'replay_{wal}.log')
    proc = context.Process(target=_replay_child, args=(replay_config, log),
                           name=f'replay_{wal}', daemon=True)
    proc.start()
    replays[wal] = (proc, replay_config.run.replay_addr)
  for _, addr in replays.values():
    probe = Client(addr, 'BenchReplayProbe')
    try:
      probe.sample_batch_eval().result(STARTUP_SECONDS)
    finally:
      probe.close(timeout=2)
  return replays


def _replay_child(config, log):
  """A --wal replay server process; its output (a line per connection)
  goes to `log`."""
  from dreamer_ver.runtime.replay_process import serve_replay
  with open(log, 'w') as file:
    os.dup2(file.fileno(), 1)
    os.dup2(file.fileno(), 2)
    sys.exit(serve_replay(config))


def stop_replays(replays):
  for proc, _ in replays.values():
    proc.kill()  # Its data is thrown away: no save.
    proc.join()


