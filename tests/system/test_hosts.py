"""A split launch across hosts, and the network between them failing.

The hosts are network namespaces on this machine joined by a bridge
(`bench/hosts/netns.py`): the servers (replay, logger), the agent, two env
hosts with two envs each, and a spare. Every fault but the last is healed
after CUT = 20 s (the soak's are 30 s; a shorter cut is also over sooner
for TCP, whose resends back off: the first after it comes about 5 s
later instead of 21), with `run.peer_timeout` 60 s, over twice the
longest silence a cut makes (about 25 s):

  an env host partitioned   the actor serves the other host's envs
                            throughout; the cut-off envs go on once healed
  the servers' host cut off the agent names the silent replay within
                            run.peer_timeout / 6; the run goes on once
                            healed, without a restart
  one direction only        an env host whose packets are lost while it
                            still receives: the same as a partition
  a host that vanishes      cut off for good, its processes killed, so
                            the agent's connections to it stay half open;
                            a fleet on a spare host gets the same env ids

Then the stored rows are checked as the chaos soak does (bench/soaks/chaos.py):
no acknowledged row lost or stored twice, no env acted with another's
carry, no episode logged twice. Needs root and iproute2 (CI has both);
skipped with the reason elsewhere.
"""

import collections
import os
import re
import signal
import time

import pytest

from bench.hosts.netns import Hosts, unavailable
from bench.soaks import watch
from bench.soaks.chaos_hosts import Run, run_flags
from bench.soaks.faults import check_rows

WHY = unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=str(WHY))

LENGTH = 50
CUT = 20
FLAGS = run_flags(envs=4, length=LENGTH, peer_timeout=60)
FLEETS = {'envs_a': (0, 1), 'envs_b': (2, 3)}
HOSTS = ['servers', 'agent', *FLEETS, 'spare']


def _goes_on(run, envs, timeout):
  """Whether `envs` finish an episode within `timeout` seconds from now."""
  now = time.time()
  return watch.wait(lambda: run.episodes(envs, now) > 0, timeout)


def test_partitions_one_way_loss_and_a_vanished_host(tmp_path):
  logdir = tmp_path / 'run'
  with Hosts(HOSTS) as hosts:
    run = Run(hosts, logdir, FLAGS)
    run.start_servers_and_agent()
    for host, envs in FLEETS.items():
      run.start_fleet(host, envs)
    assert watch.wait(lambda: run.episodes(range(4), 0) >= 8, 300), (
        run.output('agent')[-3000:])
    a, b = FLEETS['envs_a'], FLEETS['envs_b']

    # An env host partitioned: the other host's envs are served throughout.
    hosts.partition('envs_a')
    cut = time.time()
    time.sleep(CUT)
    served_b = run.episodes(b, cut + 5)
    stuck_a = run.episodes(a, cut + 5)
    hosts.heal('envs_a')
    assert served_b >= 4 and stuck_a == 0, (served_b, stuck_a)
    assert _goes_on(run, a, 120), run.output('envs_a')[-3000:]

    # The servers' host cut off: named within a sixth of peer_timeout.
    hosts.partition('servers')
    time.sleep(CUT)
    hosts.heal('servers')
    assert re.search(r'answered nothing for \d+ s', run.output('agent')), (
        run.output('agent')[-3000:])
    assert _goes_on(run, range(4), 120), run.output('agent')[-3000:]

    # One direction: what envs_b sends is lost, what it is sent arrives.
    hosts.drop_outgoing('envs_b')
    cut = time.time()
    time.sleep(CUT)
    stuck_b = run.episodes(b, cut + 5)
    hosts.heal('envs_b')
    assert stuck_b == 0, stuck_b
    assert _goes_on(run, b, 120), run.output('envs_b')[-3000:]

    # envs_a vanishes for good: its processes die while it is cut off, so
    # no close reaches the agent, whose connections to it stay half open;
    # a fleet on a spare host takes over env ids 0 and 1.
    hosts.partition('envs_a')
    pids = [pid for name, pid in watch.pids(logdir).items()
            if name in ('env0', 'env1')]
    os.killpg(run.procs['envs_a'].pid, signal.SIGKILL)
    for pid in pids:
      os.kill(pid, signal.SIGKILL)
    run.procs.pop('envs_a').wait()
    run.start_fleet('spare', a)
    assert _goes_on(run, a, 120), (
        run.output('agent')[-3000:], run.output('spare')[-3000:])

    # The operators stop the run: envs, the agent, then the servers.
    codes = {name: run.stop(name)
             for name in ('spare', 'envs_b', 'agent', 'replay', 'logger')}
  outputs = {name: run.output(name) for name in codes}
  assert codes == dict.fromkeys(codes, 0), (codes, {
      name: text[-2000:] for name, text in outputs.items()})
  restarts = collections.Counter(
      name for name, text in outputs.items() if 'restarting in' in text)
  assert not restarts, {name: outputs[name][-3000:] for name in restarts}
  report = check_rows(logdir, LENGTH)
  assert report['stored_rows'] > 0
  assert (report['lost_rows'], report['duplicated_rows'],
          report['carries_mixed'], report['episodes_twice']) == (
              0, 0, 0, 0), report
