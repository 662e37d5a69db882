"""The library API (`dreamer_ver/inference/server.py`): any jitted batched policy
served to many callers, with per-env carries, checked by value.

The carry of each env is a counter and a running sum of what that env sent:
if any row's carry went to another env, or a padding row wrote into a real
env's slot, the numbers an env gets back are wrong.
"""

import multiprocessing
import queue
import socket
import threading
import time

import jax.numpy as jnp
import numpy as np
import portal
import pytest

from dreamer_ver.actor import preemption
from dreamer_ver.inference.server import InferenceServer
from dreamer_ver.rpc import BlockingClient, ShmClient, split_addr, wire
from dreamer_ver.rpc.transport import Transport
from helpers.compiles import compiles

TIMEOUT = 20.0
SPEC = {'x': ((), np.float32), 'is_first': ((), np.bool_)}
CARRY = {'count': jnp.int32(0), 'total': jnp.float32(0)}


def counting(carry, obs):
  """Counts the calls and sums `x` of each env since its `is_first`."""
  first = obs['is_first']
  count = jnp.where(first, 0, carry['count']) + 1
  total = jnp.where(first, 0.0, carry['total']) + obs['x']
  carry = {'count': count, 'total': total}
  return carry, {'count': count, 'total': total, 'double': 2 * obs['x']}


def run_env(call, envid, steps, results):
  """One env: `steps` calls with x = 1000 envid + t, an is_first at t=0
  and again halfway (the carry resets there)."""
  half = steps // 2
  for t in range(steps):
    x = np.float32(1000 * envid + t)
    out = call({'x': x, 'is_first': np.bool_(t in (0, half)),
                'envid': np.int64(envid)})
    start = 0 if t < half else half
    expected_total = sum(1000 * envid + s for s in range(start, t + 1))
    results.append((envid, t, int(out['count']), float(out['total']),
                    float(out['double']), t - start + 1, expected_total,
                    2 * float(x)))


def check(results, envs, steps):
  assert len(results) == envs * steps
  for envid, t, count, total, double, want_count, want_total, want_double in (
      results):
    assert (count, total, double) == (want_count, want_total, want_double), (
        envid, t)


def serve_threads(calls, steps):
  results = []
  threads = [threading.Thread(target=run_env, args=(call, i, steps, results))
             for i, call in enumerate(calls)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(TIMEOUT)
  assert not any(thread.is_alive() for thread in threads)
  return results


@pytest.mark.parametrize('cutoff', ['default', 'fixed'])
def test_carries_come_back_to_their_env_in_varying_batches(cutoff):
  """Default: batches of whatever is queued (sizes vary with the threads'
  timing). Fixed(3) with three envs: every batch is the three envs padded
  to the bucket of 4, so the padding row runs beside real rows each time."""
  envs, steps = (6, 20) if cutoff == 'default' else (3, 20)
  kwargs = {} if cutoff == 'default' else {'cutoff': preemption.Fixed(3)}
  server = InferenceServer(counting, SPEC, carry=CARRY, slots=envs,
                           buckets=[1, 2, 4], **kwargs).start()
  try:
    clients = [server.client() for _ in range(envs)]
    results = serve_threads(
        [lambda data, c=c: c.call(data, TIMEOUT) for c in clients], steps)
  finally:
    server.close()
  check(results, envs, steps)
  stats = server.stats()
  assert stats['requests'] == envs * steps
  if cutoff == 'fixed':
    assert stats['batch_sizes'] == {3: steps}
  assert server.error is None


def test_shared_memory_clients_get_their_carries():
  envs, steps = 3, 12
  server = InferenceServer(counting, SPEC, carry=CARRY, slots=envs,
                           transports=('shm', 'thread')).start()
  try:
    assert server.out_spec == {'count': ((), np.dtype(np.int32)),
                               'total': ((), np.dtype(np.float32)),
                               'double': ((), np.dtype(np.float32))}
    clients = [ShmClient(server.addr, server.out_spec, server.handshake)
               for _ in range(envs)]
    for client in clients:
      stop = threading.Event()
      timer = threading.Timer(TIMEOUT, stop.set)
      timer.start()
      assert client.connect(stop)
      timer.cancel()
    results = serve_threads(
        [lambda data, c=c: c.call('act', data) for c in clients], steps)
    for client in clients:
      client.close()
  finally:
    server.close()
  check(results, envs, steps)


def test_unmodified_portal_clients_get_their_carries_with_the_option():
  envs, steps = 2, 10
  server = InferenceServer(counting, SPEC, carry=CARRY, slots=envs,
                           transports=('tcp',), logging=False,
                           plain_handshake=True).start()
  clients = [portal.Client(server.addr, logging=False,
                           handshake=server.handshake) for _ in range(envs)]
  try:
    results = serve_threads(
        [lambda data, c=c: c.act(data).result(TIMEOUT) for c in clients],
        steps)
  finally:
    for client in clients:
      client.close()
    server.close()
  check(results, envs, steps)


def test_a_stranger_without_the_token_takes_no_slot():
  """portal's default handshake (no token) is closed before any call is
  read; the owner's envs then get every slot."""
  server = InferenceServer(counting, SPEC, carry=CARRY, slots=2,
                           transports=('tcp',), logging=False).start()
  stop = threading.Event()
  timer = threading.Timer(TIMEOUT, stop.set)
  timer.start()
  owner = None
  try:
    for envid in range(2):
      with socket.create_connection(split_addr(server.addr), TIMEOUT) as sock:
        try:
          sock.sendall(b'portal_handshake')
          wire.send(sock, wire.request(0, 'act', [{
              'x': np.float32(1), 'is_first': np.bool_(True),
              'envid': np.int64(envid)}]))
          answer = sock.recv(1)
        except ConnectionResetError:
          answer = b''
        assert answer == b'', 'a stranger was answered'
    owner = BlockingClient(server.addr, server.handshake)
    assert owner.connect(stop)
    for envid in range(2):
      out = owner.call('act', {'x': np.float32(3), 'is_first': np.bool_(True),
                               'envid': np.int64(envid)}, stop=stop)
      assert (int(out['count']), float(out['total'])) == (1, 3.0)
  finally:
    timer.cancel()
    if owner is not None:
      owner.close()
    server.close()


def test_without_carries_bad_calls_fail_alone():
  server = InferenceServer(
      lambda obs: {'y': obs['x'] * 3}, {'x': ((2,), np.float32)},
      cutoff=preemption.Fixed(3), slots=4).start()
  try:
    clients = [server.client() for _ in range(3)]
    good = clients[0].submit({'x': np.array([1, 2], np.float32)})
    wrong = clients[1].submit({'x': np.array([1, 2, 3], np.float32)})
    extra = clients[2].submit({'x': np.zeros(2, np.float32), 'z': 1})
    np.testing.assert_array_equal(good.result(TIMEOUT)['y'], [3, 6])
    with pytest.raises(RuntimeError, match=r"key 'x': expected float32\[2\]"):
      wrong.result(TIMEOUT)
    with pytest.raises(RuntimeError, match="unexpected key 'z'"):
      extra.result(TIMEOUT)
  finally:
    server.close()


def test_a_new_env_without_a_free_slot_is_refused_and_others_go_on():
  server = InferenceServer(counting, SPEC, carry=CARRY, slots=2).start()
  try:
    client = server.client()

    def call(envid, x, first=False):
      return client.call({'x': np.float32(x), 'is_first': np.bool_(first),
                          'envid': np.int64(envid)}, TIMEOUT)

    assert int(call(0, 5, True)['count']) == 1
    assert int(call(1, 7, True)['count']) == 1
    with pytest.raises(RuntimeError, match='all 2 slots'):
      call(2, 9, True)
    out = call(0, 6)
    assert (int(out['count']), float(out['total'])) == (2, 11.0)
    out = call(1, 1)
    assert (int(out['count']), float(out['total'])) == (2, 8.0)
  finally:
    server.close()


def test_a_cutoff_larger_than_the_largest_bucket_is_refused():
  with pytest.raises(ValueError, match='largest bucket is 4'):
    InferenceServer(counting, SPEC, carry=CARRY, slots=4,
                    cutoff=preemption.VER(1, 8))


def scaled(params, carry, obs):
  count = jnp.where(obs['is_first'], 0, carry['count']) + 1
  return {'count': count, 'total': carry['total']}, {
      'y': params['w'] * obs['x'] + params['b'], 'count': count}


PARAMS = {'w': jnp.float32(2.0), 'b': jnp.float32(0.0)}


def test_a_weight_update_changes_the_actions_and_their_version_without_a_recompile():
  """A trainer's new params reach the next batch (TorchRL's weight sync):
  replies say which version acted, and nothing traces or compiles again."""
  server = InferenceServer(scaled, SPEC, carry=CARRY, slots=2,
                           params=PARAMS, version=3).start()
  client = server.client()
  try:
    call = lambda x, first: client.call(  # noqa: E731
        {'x': np.float32(x), 'is_first': np.bool_(first), 'envid': np.int64(0)})
    out = call(5.0, True)
    assert (float(out['y']), int(out['version']), int(out['count'])) == (
        10.0, 3, 1)
    with compiles() as seen:
      server.update({'w': jnp.float32(-1.0), 'b': jnp.float32(0.5)}, 4)
      out = call(5.0, False)
    assert (float(out['y']), int(out['version']), int(out['count'])) == (
        -4.5, 4, 2)  # New weights, the carry goes on.
    assert seen == []
    assert server.out_spec['version'] == ((), np.dtype(np.int64))
  finally:
    server.close()


class QueueTransport(Transport):
  """A user's transport: env threads put (client, reqnum, data) on one
  request queue and read their replies from a queue of their own."""

  kind = 'queues'

  def __init__(self, clients):
    super().__init__()
    self.requests = queue.Queue()
    self.replies = [queue.Queue() for _ in range(clients)]
    self.conns = {('queues', i) for i in range(clients)}

  def receive(self, timeout):
    try:
      client, reqnum, data = self.requests.get(timeout=timeout)
    except queue.Empty:
      return []
    if data is None:  # The client says goodbye.
      self.conns.discard(('queues', client))
      self.disconnects += 1
      return []
    return [(('queues', client), reqnum, data)]

  def reply(self, conn, reqnum, value):
    self.replies[conn[1]].put((reqnum, 0, value))
    return True

  def error_reply(self, conn, reqnum, status, message):
    self.replies[conn[1]].put((reqnum, status, message))
    return True

  def caller(self, client):
    """Env `client`'s call through this transport."""
    reqnums = iter(range(10 ** 6))

    def call(data):
      reqnum = next(reqnums)
      self.requests.put((client, reqnum, data))
      got, status, value = self.replies[client].get(timeout=TIMEOUT)
      assert got == reqnum and status == 0, value
      return value
    return call


def test_a_transport_of_your_own_serves_with_the_built_in_ones():
  envs, steps = 3, 8
  transport = QueueTransport(envs)
  server = InferenceServer(counting, SPEC, carry=CARRY, slots=envs + 1,
                           transports=('thread', transport)).start()
  try:
    calls = [server.client().call] + [  # env 0 local, then 1, 2, 3
        transport.caller(i) for i in range(envs)]
    results = serve_threads(calls, steps)
    check(results, envs + 1, steps)
    for client in range(envs):
      transport.requests.put((client, None, None))
    deadline = time.monotonic() + TIMEOUT
    while transport.conns and time.monotonic() < deadline:
      time.sleep(0.05)
    assert not transport.conns  # Every client said goodbye.
  finally:
    server.close()


def test_max_batch_size_and_timeout_cut_full_batches_or_late_ones():
  """TorchRL's batching: at most `max_batch_size` calls per batch, and a
  batch fills for at most `timeout` seconds."""
  server = InferenceServer(counting, SPEC, carry=CARRY, slots=8,
                           max_batch_size=4, timeout=1.0).start()
  try:
    assert server.policy.buckets == [1, 2, 4]
    client = server.client()
    futures = [client.submit({'x': np.float32(e), 'is_first': np.bool_(True),
                              'envid': np.int64(e)}) for e in range(6)]
    for e, future in enumerate(futures):
      assert float(future.result(TIMEOUT)['total']) == e
    stats = server.stats()
    assert stats['batch_sizes'] == {2: 1, 4: 1}, stats
    assert (stats['cut/max'], stats['cut/timeout']) == (1, 1)
  finally:
    server.shutdown()
  with pytest.raises(ValueError, match='cutoff or a timeout'):
    InferenceServer(counting, SPEC, carry=CARRY, timeout=0.1,
                    cutoff=preemption.Fixed(2))


def trainer_and_env(client, sender, done):
  """Another process: an env that calls through the mp transport, and a
  trainer that pushes new weights between two of its calls."""
  obs = {'x': np.float32(5.0), 'is_first': np.bool_(True),
         'envid': np.int64(1)}
  before = client.call(obs, timeout=TIMEOUT)
  sender.send({'w': np.float32(-1.0), 'b': np.float32(0.5)}, 7)
  try:
    sender.send({'w': np.zeros(3, np.float32), 'b': np.float32(0)}, 8)
    refused = ''
  except ValueError as error:
    refused = str(error)
  after = client.call({**obs, 'is_first': np.bool_(False)}, timeout=TIMEOUT)
  client.close()
  done.put([(float(r['y']), int(r['version']), int(r['count']))
            for r in (before, after)] + [refused])


def test_a_trainer_in_another_process_pushes_weights_its_env_acts_with():
  """The mp transport and the weight sync across processes, by value: the
  pushed weights act in the next batch without a recompile, replies say
  their version, the carry goes on, and params of another shape are
  refused to the sender."""
  from dreamer_ver.inference.client import InferenceClient, WeightSender
  from dreamer_ver.rpc import MPTransport
  transport = MPTransport()
  server = InferenceServer(
      scaled, SPEC, carry=CARRY, slots=4, params=PARAMS, version=3,
      transports=('tcp', transport), weight_sync=True, logging=False).start()
  context = multiprocessing.get_context('spawn')
  done = context.Queue()
  sender = WeightSender(server.weight_sync_addr, server.handshake)
  proc = context.Process(target=trainer_and_env, args=(
      transport.client(), sender, done))
  try:
    with compiles() as seen:  # The pushed weights compile nothing here.
      proc.start()
      before, after, refused = done.get(timeout=120)
      here = InferenceClient(server.endpoint('tcp'))
      out = here({'x': np.float32(1.0), 'is_first': np.bool_(True),
                  'envid': np.int64(2)})
    assert seen == []
    assert before == (10.0, 3, 1) and after == (-4.5, 7, 2)
    assert refused == 'w is float32[3], the served one float32[]', refused
    assert (float(out['y']), int(out['version'])) == (-0.5, 7)
    here.close()
    deadline = time.monotonic() + TIMEOUT
    while transport.conns and time.monotonic() < deadline:
      time.sleep(0.05)
    assert not transport.conns  # The env's client said goodbye.
  finally:
    proc.join(TIMEOUT)
    if proc.is_alive():
      proc.kill()
    server.shutdown()


def test_an_inference_client_reaches_the_server_over_any_transport():
  """One client class for every route: the server itself (in-process),
  a pickled endpoint (shm, tcp), a transport's own client."""
  import pickle
  from dreamer_ver.inference.client import InferenceClient
  server = InferenceServer(counting, SPEC, carry=CARRY, slots=4,
                           transports=('thread', 'shm', 'tcp'),
                           logging=False).start()
  try:
    clients = [InferenceClient(server),
               pickle.loads(pickle.dumps(InferenceClient(
                   server.endpoint('shm')))),
               pickle.loads(pickle.dumps(InferenceClient(
                   server.endpoint('tcp'))))]
    results = serve_threads(clients, 6)
    check(results, 3, 6)
    with pytest.raises(RuntimeError, match="unexpected key 'z'"):
      clients[2]({'x': np.float32(1), 'is_first': np.bool_(True),
                  'envid': np.int64(3), 'z': np.float32(0)})
    for client in clients:
      client.close()
    with pytest.raises(TypeError, match='Endpoint'):
      pickle.dumps(InferenceClient(server))
    with pytest.raises(ValueError, match="'tcp' or 'shm'"):
      server.endpoint('thread')
  finally:
    server.close()


def test_an_object_without_the_interface_is_refused_naming_what_it_lacks():
  with pytest.raises(TypeError, match="lacks.*'receive'"):
    InferenceServer(counting, SPEC, carry=CARRY, transports=[object()])
