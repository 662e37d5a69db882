"""A transport library for portal's wire protocol: what our processes use to
talk, on one screen. Like portal itself it imports nothing of dreamer_ver;
an unmodified `portal.Client` talks to our servers (with a token, only if
they take plain handshakes), and our clients to portal's servers (without
a token).

  wire           frames: length prefix, request and reply layout, connect
  auth           the token handshake: a challenge-response, token unsent
  addresses      'host:port' parsing, bind interface, free ports, handshakes
  server_socket  portal's ServerSocket, hardened (bad frames cost only their
                 connection), plus call parsing and reply sending
  server         Server: methods on worker pools that sleep while idle
                 (portal.Server polls every 0.1 ms)
  batch_server   BatchServer: gathers calls of one method into batches cut
                 by a pluggable cutoff policy (portal.BatchServer waits for
                 a fixed count), from one or more transports at once:
  tcp_transport    portal's protocol, any host
  shm              shared-memory slots for callers on the server's host
                   (ShmClient), a 13-byte message per call
  thread_transport in-process callers (ThreadClient, `BatchServer.client()`)
  mp_transport     callers in processes this one starts, over
                   multiprocessing queues (MPTransport)
  ray_transport    callers on Ray workers, through a Ray actor
  batch_stats      what the batch server counts between two stats() calls
  client         Client: futures, bounded in-flight calls, reconnect and
                 resend (portal.Client's socket thread can busy-poll)
  blocking_client  BlockingClient: no thread at all, for env processes
"""

from .addresses import fill_auto_ports, free_port, handshake, split_addr
from .batch_server import BatchServer, Request
from .blocking_client import BlockingClient
from .client import Client, Dropped
from .mp_transport import MPClient, MPTransport
from .server import Server
from .shm_client import ShmClient
from .thread_transport import ThreadClient

__all__ = [
    'BatchServer', 'BlockingClient', 'Client', 'Dropped', 'MPClient',
    'MPTransport', 'Request', 'Server', 'ShmClient', 'ThreadClient',
    'fill_auto_ports', 'free_port', 'handshake', 'split_addr',
]
