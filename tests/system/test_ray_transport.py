"""The Ray transport (`rpc/ray_transport.py`): env clients on Ray workers
served by an InferenceServer through Ray only, beside an in-process client,
carries checked by value; a bad call errors its caller only; a client that
closes or dies frees its env id."""

import sys

import jax.numpy as jnp
import numpy as np
import pytest

from bench.soaks.watch import wait
from dreamer_ver.inference.server import InferenceServer

ray = pytest.importorskip('ray')
# One Ray instance at a time where tests run side by side (.ci/run: -n 2
# --dist loadgroup).
pytestmark = pytest.mark.xdist_group('ray')
from dreamer_ver.rpc.ray_transport import RayTransport  # noqa: E402

SPEC = {'x': ((), np.float32), 'is_first': ((), np.bool_)}
CARRY = {'count': jnp.int32(0), 'total': jnp.float32(0)}
TIMEOUT = 60.0


def counting(carry, obs):
  """Counts each env's calls and sums its `x` since its `is_first`."""
  count = jnp.where(obs['is_first'], 0, carry['count']) + 1
  total = jnp.where(obs['is_first'], 0.0, carry['total']) + obs['x']
  carry = {'count': count, 'total': total}
  return carry, {'count': count, 'total': total}


def env_loop(client, envid, steps):
  """`steps` calls with x = 1000 envid + t; returns what should and what
  did come back, per step."""
  rows = []
  for t in range(steps):
    out = client.call({'x': np.float32(1000 * envid + t),
                       'is_first': np.bool_(t == 0),
                       'envid': np.int64(envid)}, timeout=TIMEOUT)
    want = (t + 1, float(sum(1000 * envid + s for s in range(t + 1))))
    rows.append((want, (int(out['count']), float(out['total']))))
  client.close()
  return rows


@pytest.fixture
def server():
  ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
  ray.init(address='local', num_cpus=2, include_dashboard=False)
  transport = RayTransport(expire=2.0)
  server = InferenceServer(counting, SPEC, carry=CARRY, slots=8,
                           transports=('thread', transport)).start()
  yield server, transport
  server.close()
  ray.shutdown()


def test_env_clients_on_ray_workers_are_served_through_ray(server):
  server, transport = server
  loop = ray.remote(num_cpus=0.1)(env_loop)
  remote = [loop.remote(transport.client(), envid, 12) for envid in (1, 2, 3)]
  local = env_loop(server.client(), 0, 12)  # beside them, in-process
  for rows in [local] + ray.get(remote, timeout=TIMEOUT):
    assert [want for want, _ in rows] == [got for _, got in rows]
  assert wait(lambda: not transport.conns, TIMEOUT, poll=0.05)
  assert transport.disconnects == 3


def test_a_bad_call_errors_its_caller_and_a_dead_client_frees_its_env(server):
  server, transport = server
  bad = transport.client()
  with pytest.raises(RuntimeError, match="missing key 'is_first'"):
    bad.call({'x': np.float32(1), 'envid': np.int64(5)}, timeout=TIMEOUT)
  # Not even a dict of arrays: the transport refuses it itself.
  ok, message = ray.get(bad.inbox.call.remote(bad.conn, 'text'),
                        timeout=TIMEOUT)
  assert not ok and 'dict of numpy arrays' in message
  assert transport.refused == 1
  # A client that holds env 4 and never closes (its worker died) ...
  gone = transport.client()
  gone.call({'x': np.float32(1), 'is_first': np.bool_(True),
             'envid': np.int64(4)}, timeout=TIMEOUT)
  # ... keeps it while it may still come back ...
  other = transport.client()
  with pytest.raises(RuntimeError, match='env id 4 is already used') as (
      taken):
    other.call({'x': np.float32(2), 'is_first': np.bool_(True),
                'envid': np.int64(4)}, timeout=TIMEOUT)
  assert taken.value.kind == 'EnvIdTaken'  # what an env waits on
  # ... and loses it `expire` (2 s) after its last call, once the server
  # sweeps; others are served.
  def freed():
    try:
      other.call({'x': np.float32(2), 'is_first': np.bool_(True),
                  'envid': np.int64(4)}, timeout=TIMEOUT)
    except RuntimeError as error:
      if getattr(error, 'kind', None) != 'EnvIdTaken':
        raise
      return False
    return True
  assert wait(freed, TIMEOUT), 'env id 4 was never freed'
  rows = env_loop(other, 4, 3)
  assert [want for want, _ in rows] == [got for _, got in rows]
  rows = env_loop(bad, 5, 3)  # the client whose call was refused, too
  assert [want for want, _ in rows] == [got for _, got in rows]
