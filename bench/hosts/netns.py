"""Hosts on one machine: network namespaces joined by a bridge, for faults
between hosts (partitions, one-way loss, a host that vanishes) in the
system tier and the multi-host chaos soak. They need root and iproute2;
`unavailable()` says why not.

  with Hosts(['servers', 'agent', 'envs']) as hosts:
    hosts.addr['agent']                  # '10.213.0.2'
    hosts.popen('agent', argv, ...)      # a process on that host
    hosts.partition('envs')              # its link down, both ways
    hosts.drop_outgoing('envs')          # what it sends is lost
    hosts.heal('envs')

Each host has its own loopback and one interface on the bridge, which
lives in a namespace of its own (`switch`), so nothing touches the
machine's own network. Namespace and link names carry this process's pid:
runs beside each other do not meet.
"""

import os
import shutil
import subprocess

SUBNET = '10.213.0'
NOWHERE = '02:00:00:00:00:01'  # a hardware address no host has


def unavailable():
  """Why hosts cannot be made here, else None."""
  if os.geteuid() != 0:
    return 'network namespaces need root'
  if shutil.which('ip') is None:
    return 'iproute2 (ip) is not installed'
  probe = f'dvprobe{os.getpid()}'
  made = subprocess.run(['ip', 'netns', 'add', probe], capture_output=True,
                        text=True, check=False)
  if made.returncode:
    return f'cannot make a network namespace: {made.stderr.strip()}'
  subprocess.run(['ip', 'netns', 'del', probe], check=False)
  return None


class Hosts:

  def __init__(self, names):
    tag = os.getpid() % 100000
    self.names = list(names)
    self.switch = f'dvsw{tag}'
    self.ns = {name: f'dv{i}h{tag}' for i, name in enumerate(self.names)}
    self.port = {name: f'dv{i}p{tag}' for i, name in enumerate(self.names)}
    self.addr = {name: f'{SUBNET}.{i + 1}' for i, name in
                 enumerate(self.names)}
    self.procs = []

  def __enter__(self):
    try:
      _ip('netns', 'add', self.switch)
      _ip('-n', self.switch, 'link', 'add', 'br0', 'type', 'bridge')
      _ip('-n', self.switch, 'link', 'set', 'br0', 'up')
      for name in self.names:
        ns, port = self.ns[name], self.port[name]
        _ip('netns', 'add', ns)
        _ip('-n', ns, 'link', 'set', 'lo', 'up')
        _ip('-n', ns, 'link', 'add', 'eth0', 'type', 'veth', 'peer', 'name',
            port, 'netns', self.switch)
        _ip('-n', ns, 'addr', 'add', f'{self.addr[name]}/24', 'dev', 'eth0')
        _ip('-n', ns, 'link', 'set', 'eth0', 'up')
        _ip('-n', self.switch, 'link', 'set', port, 'master', 'br0')
        _ip('-n', self.switch, 'link', 'set', port, 'up')
    except BaseException:
      self.__exit__()
      raise
    return self

  def __exit__(self, *exc):
    for proc in self.procs:
      if proc.poll() is None:
        os.killpg(proc.pid, 9)
        proc.wait()
    for ns in [*self.ns.values(), self.switch]:
      subprocess.run(['ip', 'netns', 'del', ns], capture_output=True,
                     check=False)

  def popen(self, name, argv, **kwargs):
    """`argv` on host `name`, a process group of its own (killed at exit
    if still there)."""
    proc = subprocess.Popen(['ip', 'netns', 'exec', self.ns[name], *argv],
                            start_new_session=True, **kwargs)
    self.procs.append(proc)
    return proc

  def partition(self, name):
    """Cuts host `name` off: nothing it sends or is sent arrives, and no
    one is told (no reset, no close): the other side's connections stay
    half open."""
    _ip('-n', self.switch, 'link', 'set', self.port[name], 'down')

  def drop_outgoing(self, name):
    """What host `name` sends is lost; what it is sent still arrives. (Its
    neighbour table sends to a hardware address no one has: this kernel
    may lack tc's classifiers and nftables.)"""
    for other in self.names:
      if other != name:
        _ip('-n', self.ns[name], 'neigh', 'replace', self.addr[other],
            'lladdr', NOWHERE, 'nud', 'permanent', 'dev', 'eth0')

  def heal(self, name):
    """Undoes `partition` and `drop_outgoing` for host `name`."""
    for other in self.names:  # (`neigh flush` keeps permanent entries)
      if other != name:
        subprocess.run(['ip', '-n', self.ns[name], 'neigh', 'del',
                        self.addr[other], 'dev', 'eth0'],
                       capture_output=True, check=False)
    _ip('-n', self.switch, 'link', 'set', self.port[name], 'up')


def _ip(*args):
  subprocess.run(['ip', *args], check=True, capture_output=True)


