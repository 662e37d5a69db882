"""How the components of a run reach each other: `Links`, the server and
client settings a run's config implies, and where a peer is now.

Servers bind to the host named in their `host:port` address
(`rpc/addresses.py`), or to `run.bind_host` when set (e.g. `0.0.0.0` on a
multi-host run), and accept only clients that prove they know the run
token (`token.py`, `rpc/auth.py`). Clients connect to
`client_address(addr)`: on a Ray cluster the addresses are names that Ray
resolves.
"""

import dataclasses
from collections.abc import Mapping

from dreamer_ver.rpc import addresses
from dreamer_ver.rpc.client import Client

RAY_PREFIX = 'ray:'
# The run's servers, by the name a link names them with.
SERVERS = {'replay': 'replay_addr', 'logger': 'logger_addr',
           'actor': 'actor_addr'}


@dataclasses.dataclass(frozen=True)
class Links:
  """What a component of a run needs to reach the others and be reached:
  the servers' addresses, the run token, the bind interface and the
  deadline on a silent peer, read from the run config once (`of`)."""

  addresses: Mapping  # 'replay', 'logger', 'actor' -> the address it serves
  token: str
  bind_host: str = ''  # the interface servers bind; '' = their address's
  peer_timeout: float = 0.0  # seconds a waiting call bears silence; 0 = ever
  plain_handshake: bool = False  # servers also take the token in clear

  @classmethod
  def of(cls, config):
    """The links of a run config whose token is set (`token.with_token`)."""
    run = config.run
    return cls({server: str(run[key]) for server, key in SERVERS.items()},
               str(run.token), str(run.bind_host), float(run.peer_timeout),
               bool(run.plain_handshake))

  def connect(self, server, name, **options):
    """A futures client (`rpc/client.py`) named `name` to the run's `server`
    ('replay', 'logger', 'actor'), with the run's token and peer deadline;
    `options`: maxinflight, when_full."""
    addr = client_address(self.addresses[server])
    return Client(addr, name, **self.client_kwargs(), **options)

  def server_kwargs(self):
    """Keyword arguments for our servers: the bind interface when
    `run.bind_host` sets one, the token handshake, and whether unmodified
    portal clients may send the token in clear (`run.plain_handshake`)."""
    kwargs = dict(handshake=addresses.handshake(self.token))
    if self.bind_host:
      kwargs['host'] = self.bind_host
    if self.plain_handshake:
      kwargs['plain_handshake'] = True
    return kwargs

  def client_kwargs(self):
    """Keyword arguments for our futures clients: the token handshake and
    the deadline on a peer that stopped answering."""
    return dict(handshake=addresses.handshake(self.token),
                peer_timeout=self.peer_timeout or None)


def client_address(addr):
  """The address a client of a run connects to: `addr` as it is, or for
  'ray:<name>' (or 'ray:<name>/<config key>') a lookup of where the run's
  Ray-hosted component <name> serves now, asked again at every reconnect
  (`cluster/ray_host.py`)."""
  if str(addr).startswith(RAY_PREFIX):
    from dreamer_ver.cluster.ray_host import Lookup
    name, _, key = addr[len(RAY_PREFIX):].partition('/')
    return Lookup(name, key or None)
  return addr


def resolve(addr, stop, poll=1.0):
  """`addr` as a 'host:port' string, for the callers that need one now
  (JAX's coordinator): a 'ray:' address is looked up until Ray says where
  it serves. None if `stop` is set first."""
  where = client_address(addr)
  while callable(where):
    found = where()
    if found:
      return found
    if stop.wait(poll):
      return None
  return where
