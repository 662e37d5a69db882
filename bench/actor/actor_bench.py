"""Actor throughput benchmark: DreamerV3's fixed batch vs our batch cutoffs.

For each fleet of env processes, in one invocation and on the same fleet
(the same processes, which reconnect by themselves when the server changes),
it serves the fleet with

  baseline  portal.BatchServer with a fixed batch of E/2 (DreamerV3's actor:
            the batcher in its own process, one worker thread)
  fixed     our BatchServer, preemption.Fixed(E/2)
  ver       our BatchServer, preemption.VER (min/max/adaptive wait)
  preempt   our BatchServer, preemption.Preempt (throughput-optimal)

all four calling the same jitted RSSM policy (`Actor.step`, size1m by
default), with the learner, replay and limiter off. The policy is compiled
once before any timing. Each mode gets a warm-up (after every live env was
served once) and then a fixed measuring window; `--repeats` rounds go through
all modes in turn, so drifts in the machine's other load hit every mode.

Every fleet runs once per `--transports` entry: its env processes reach our
server over TCP (portal's protocol) or through shared memory (`rpc/shm.py`);
the baseline speaks TCP only, so it runs with the tcp fleet and the shm rows
take their x baseline from it.

Fleets (E envs, one per process unless said otherwise; `--step_time` mean
seconds per step):

  constant   every env takes step_time
  hetero     every 4th env (exactly E/4 of them) is 4x slower
  lognormal  per-step lognormal factor (sigma `--jitter`), mean step_time
  bimodal    half the envs take 5 ms per step, the other half 80 ms
  faults     env 0 stalls for 2 s every 5 s; E/2 + 1 envs die (abruptly,
             os._exit) 40% into each window and are restarted before the
             next one; windows are at least 6.7 s here, so that a fleet
             that hangs after the deaths is seen to stall
  fast       dm_control cartpole_balance from proprioception (about 0.2 ms
             per step): measures the runtime's overhead, not env time
  fast_multi the same with `--envs_per_worker` envs per process (E / 4
             processes; double-buffered multi-env calls). portal's
             BatchServer cannot batch multi-env calls, so this fleet has no
             baseline of its own; its x baseline refers to `fast`'s.

Measurements, per fleet and mode:

  sps        env steps served in the window / window seconds (rows counted
             where the policy runs), summed over the rounds. A fleet that
             stalls (no step served for 3 s) ends its window early; its sps
             counts the full window, since it would serve nothing more.
  limit_sps  the env-bound limit: sum over envs of 1 / mean step time,
             weighted by the time each env is alive and not stalled. For
             `fast` it is E / the measured mean env step time.
  p50/p99    request latency as the env sees it, the same probe for every
             mode: the env processes wrap their env so that each step records
             the time from returning an observation to being called with the
             next action (send, queue, batch, policy, reply, receive). Taken
             over the replies received inside the windows; requests never
             answered (a stalled fleet) are not in them.
  extras     ratio_baseline, ratio_limit, batch_mean, policy_ms_mean (handler
             time per batch), policy_share (the fraction of the window the
             policy ran: the rest of the server's CPU is overhead),
             cpu_server / cpu_envs (cores used by the benchmark process plus
             the baseline's batcher process / by the env processes), our
             server's own latency and cut reasons, and `load`, the machine's 1-minute load average at the end of
             the window (other work on the machine skews every number).

With `--learner` a learner thread trains the same agent beside the actor,
in the same process and on the same device (zero batches of the replay's
shapes, publishing its params to the actor after each update, as
`--script parallel` does on one device), through every mode's warm-up and
window. Its updates per second are reported as `learner_ups`, beside
`learner_alone_ups`, measured before the fleet starts (the learner alone in
the process: what it keeps beside the actor is against that); with
`preempt` it reports each update's device time to the cutoff (VER's
learner time, LT). The baseline's batcher process is left out of the CPU
comparison by nothing: the learner's cores are counted in `cpu_server`.

With `--wal` the actor ships every served transition to a replay server
process (`serve_replay`, as `--script parallel` runs it; no learner, no
limiter), and every mode runs twice per round, once against a replay with
`replay.wal off` and once against one with `flush`, interleaved (the order
alternates between rounds); both replays live through the whole fleet. The
baseline is left out: portal's BatchServer calls Actor.step and ships
nothing. The summary gives env steps/s both ways, their ratio, and the
replay process's cores (`cpu_replay`).

Usage (from the repository root; see docs/benchmarks.md):

  .venv/bin/python -m bench.actor.actor_bench --out bench/results/actor_cutoffs_cpu.json \
      --plot bench/results/actor_cutoffs_cpu.png
  .venv/bin/python -m bench.actor.actor_bench --quick

Every child process (env processes, the baseline's batcher process) is
stopped at the end of each fleet or on any error (terminate, join, kill).
"""
import argparse
import os
import signal
import sys
import tempfile
import time

import numpy as np

from dreamer_ver.runtime import env_worker

from bench import stamp
from bench.actor.actor_fleets import (FLEETS, Fleet, fleet_spec,
                                      nominal_limit, with_extra)
from bench.actor.actor_load import (FAULTS_MIN_SECONDS, MODES, LearnerLoad,
                                    run_mode)
from bench.actor.actor_report import (latency_table, learner_table, plot,
                                      row, table, wal_table)
from bench.actor.actor_servers import (WAL_MODES, die_with_parent,
                                       start_replays, stop_replays)
TRANSPORTS = ('tcp', 'shm')

# --------------------------------------------------------------- fleets


def make_actor(config, extra):
  """Agent, params and a compiled Actor for the config's task."""
  from dreamer_ver.agent.agent import Agent, policy_params
  from dreamer_ver.envs import make_env
  from dreamer_ver.actor.actor import Actor
  from dreamer_ver.actor.batching import bucket_sizes
  from dreamer_ver.actor.params import ParamsStore
  env = make_env(config.task, with_extra(config.env, extra))
  agent = Agent(env.obs_space, env.act_space, config)
  env.close()
  store = ParamsStore(policy_params(agent.init_params(config.seed)))
  envs = config.run.envs
  actor = Actor(agent, store, slots=envs,
                buckets=bucket_sizes(config.run, envs), seed=config.seed)
  start = time.monotonic()
  actor.compile()
  # compile()'s single timing per bucket is noisy; re-measure so Preempt
  # starts from a fair estimate (it keeps learning while serving).
  inference = _measure_inference(actor)
  print(f'  compiled {config.task} ({time.monotonic() - start:.1f} s); '
        'inference ms per bucket:',
        {k: round(v * 1000, 2) for k, v in inference.items()}, flush=True)
  return actor, inference


def zero_requests(actor, size):
  """`size` valid requests of envs 0..size-1 with all-zero observations,
  as an env worker sends them."""
  datas = []
  for i in range(size):
    obs = {k: np.zeros(s.shape, s.dtype) for k, s in actor.obs_space.items()}
    obs['is_first'] = np.bool_(True)
    datas.append(env_worker.request([obs], [i], False, single=True))
  return datas


def _measure_inference(actor, repeats=20):
  times = {}
  for size in actor.buckets:
    datas = zero_requests(actor, size)
    samples = []
    for _ in range(repeats):
      start = time.perf_counter()
      actor.step(datas)
      samples.append(time.perf_counter() - start)
    times[size] = float(np.median(samples))
  return times


def run_fleet(name, args, actors, port, transport):
  from dreamer_ver.config import loading as configlib
  spec = fleet_spec(name, args.envs, args.step_time, args.jitter,
                    args.envs_per_worker)
  config = configlib.compose([args.size], {
      'task': spec['task'], 'run.envs': args.envs, 'run.eval_envs': 0,
      'run.actor_addr': f'127.0.0.1:{port}', 'run.actor_transport': transport,
      **spec['shared']})
  key = (spec['task'], args.size)
  if key not in actors:
    actors[key] = make_actor(config, spec['env_extra'])
  actor, inference = actors[key]
  server_config = config
  if args.rtt_ms:  # The envs reach the server through a delaying proxy.
    from dreamer_ver.rpc.addresses import free_port
    config = configlib.override(
        config, {'run.actor_addr': f'127.0.0.1:{free_port()}'})
  per = max(1, spec['per_worker'])
  groups = [list(range(i, min(i + per, args.envs)))
            for i in range(0, args.envs, per)]
  # Per-env overrides (hetero) need one env per process.
  configs = [configlib.override(config, spec['per_env'][g[0]]) if
             spec['per_env'][g[0]] else config for g in groups]
  modes = list(args.modes)
  if (per > 1 or args.wal or transport != 'tcp') and 'baseline' in modes:
    # portal.BatchServer stacks whole calls: a multi-env call would become
    # [batch, envs, ...]; upstream DreamerV3 has one env per process. It
    # calls Actor.step: nothing is shipped to a replay (--wal). It speaks
    # TCP only.
    modes.remove('baseline')
  wals = WAL_MODES if args.wal else (None,)
  rtts = args.rtt_ms or [None]
  rounds = {(rtt, mode, wal): [] for rtt in rtts for mode in modes
            for wal in wals}
  with tempfile.TemporaryDirectory(prefix='actor_bench_') as outdir:
    fleet = Fleet(configs, groups, outdir, spec['stall'], spec['env_extra'])
    replays = {}
    learner = None
    alone = None
    try:
      if args.learner:
        learner = LearnerLoad(actor, config)
        alone = learner.alone(args.warmup, args.seconds)
        print(f'  learner alone: {alone:.2f} updates/s', flush=True)
      if args.wal:
        replays = start_replays(config, outdir)
      began = time.monotonic()
      fleet.start_all()
      fleet.wait_started()
      print(f'  {args.envs} envs in {len(groups)} processes started in '
            f'{time.monotonic() - began:.1f} s', flush=True)
      # Rounds through all modes: slow drifts of the machine (other load)
      # hit every mode alike instead of one of them. The WAL variants of a
      # mode run back to back, first one and then the other in turn.
      for index in range(args.repeats):
        for rtt in rtts:
          proxy = _proxy(config, server_config, rtt)
          try:
            for mode in modes:
              for wal in (wals if index % 2 == 0 else wals[::-1]):
                replay = None
                if wal is not None:
                  proc, addr = replays[wal]
                  replay = (wal, addr, proc.pid)
                record = run_mode(mode, fleet, spec, args, actor,
                                  server_config, inference, replay, learner)
                record['rtt_ms'] = rtt
                rounds[(rtt, mode, wal)].append(record)
                print('  ' + row(record, partial=True), flush=True)
          finally:
            if proxy is not None:
              proxy.close()
    finally:
      if learner is not None:
        learner.close()
      fleet.stop()
      stop_replays(replays)
    times, latency, durations = fleet.samples()
  if spec['mean_step'] is None:
    step = float(durations.mean()) if len(durations) else float('nan')
    limit = args.envs / step
  else:
    limit = nominal_limit(spec, args.envs)
  records = [_combine(each, times, latency) for each in rounds.values()]
  for record in records:
    record['envs_per_process'] = per
    record['transport'] = transport
    if alone is not None:
      record['learner_alone_ups'] = alone
  bases = {r['rtt_ms']: r['sps'] for r in records if r['mode'] == 'baseline'}
  for record in records:
    base = bases.get(record['rtt_ms'])
    record['limit_sps'] = limit
    record['ratio_limit'] = record['sps'] / limit
    record['ratio_baseline'] = record['sps'] / base if base else None
    if spec['mean_step'] is None:
      record['env_step_ms'] = 1000 * args.envs / limit
  return records


def _proxy(config, server_config, rtt_ms):
  """With --rtt_ms: the delay proxy from the envs' address to the server's,
  for one round trip time."""
  if rtt_ms is None:
    return None
  from bench.hosts.delay_proxy import DelayProxy
  port = int(str(config.run.actor_addr).rsplit(':', 1)[1])
  host, target = str(server_config.run.actor_addr).rsplit(':', 1)
  return DelayProxy(port, (host, int(target)), rtt_ms)


def _combine(rounds, times, latency):
  """One record from the rounds of one mode: rows over seconds in all, the
  env-side latency percentiles over every window, averages of the rest."""
  first = rounds[0]
  seconds = sum(r['seconds'] for r in rounds)
  rows = sum(r['rows'] for r in rounds)
  batches = sum(r['batches'] for r in rounds)
  inside = np.zeros(len(times), bool)
  for r in rounds:
    inside |= (times >= r['t0']) & (times <= r['t1'])
  lat = latency[inside] * 1000
  record = dict(
      fleet=first['fleet'], mode=first['mode'], envs=first['envs'],
      wal=first['wal'], rtt_ms=first['rtt_ms'], sps=rows / seconds,
      p50_ms=float(np.percentile(lat, 50)) if len(lat) else None,
      p99_ms=float(np.percentile(lat, 99)) if len(lat) else None,
      stalled=any(r['stalled'] for r in rounds),
      rows=rows, seconds=seconds, rounds=len(rounds), batches=batches,
      batch_mean=rows / batches if batches else 0.0,
      latency_samples=int(len(lat)),
      round_sps=[r['sps'] for r in rounds])
  weigh = lambda key: sum(r[key] * r['seconds'] for r in rounds) / seconds
  for key in ('cpu_server', 'cpu_envs', 'cpu_replay', 'load', 'policy_share'):
    record[key] = weigh(key)
  record['env_crashes'] = sum(r['env_crashes'] for r in rounds)
  record['policy_ms_mean'] = (
      sum(r['policy_ms_mean'] * r['batches'] for r in rounds) / batches
      if batches else 0.0)
  if 'learner_ups' in first:
    record['learner_ups'] = weigh('learner_ups')
  for key in ('server_p50_ms', 'server_p99_ms', 'queue_wait_p50_ms',
              'wait_error_ms', 'learner_ms_per_batch', 'expected_batch',
              'real_batch'):
    if key in first:
      record[key] = float(np.mean([r[key] for r in rounds]))
  if 'cuts' in first:
    cuts = {}
    for r in rounds:
      for k, v in r['cuts'].items():
        cuts[k] = cuts.get(k, 0) + v
    record['cuts'] = cuts
  return record

# ----------------------------------------------------------------- main


def parse_args(argv=None):
  parser = argparse.ArgumentParser(
      description=__doc__.split('\n\n')[0])
  parser.add_argument('--fleets', nargs='+', default=list(FLEETS),
                      choices=FLEETS, help='fleets to run (all)')
  parser.add_argument('--modes', nargs='+', default=list(MODES),
                      choices=MODES, help='modes to run (all; the '
                      'baseline always runs first)')
  parser.add_argument('--transports', nargs='+', default=list(TRANSPORTS),
                      choices=TRANSPORTS, help='how the env processes reach '
                      'our server; each fleet runs once per transport (tcp '
                      'shm)')
  parser.add_argument('--envs', type=int, default=None,
                      help='env processes per fleet (16; 8 with --quick)')
  parser.add_argument('--seconds', type=float, default=None,
                      help='measuring window per mode and round (6; 3 with '
                      '--quick); at least %.1f s for the faults fleet'
                      % FAULTS_MIN_SECONDS)
  parser.add_argument('--warmup', type=float, default=None,
                      help='seconds served before each window (2; 1 with '
                      '--quick)')
  parser.add_argument('--repeats', type=int, default=None,
                      help='rounds through all modes per fleet; sps sums '
                      'rows and seconds over the rounds (2; 1 with --quick)')
  parser.add_argument('--step_time', type=float, default=0.02,
                      help='mean env step seconds of the synthetic fleets '
                      '(0.02)')
  parser.add_argument('--jitter', type=float, default=0.5,
                      help='lognormal sigma of the lognormal fleet (0.5)')
  parser.add_argument('--envs_per_worker', type=int, default=4,
                      help='envs per process in the fast_multi fleet (4)')
  parser.add_argument('--size', default='size1m',
                      help='model size block of the policy (size1m; e.g. '
                      'size12m)')
  parser.add_argument('--quick', action='store_true',
                      help='8 envs, one 3 s window per mode: under 3 minutes '
                      'on 2 cores')
  parser.add_argument('--wait_load', type=float, default=0.0,
                      help='before each fleet, wait (up to 15 min) until the '
                      '1-minute load average is below this (0: do not wait)')
  parser.add_argument('--wal', action='store_true',
                      help='ship transitions to a replay server process and '
                      'run every mode against one with replay.wal off and '
                      'one with flush, interleaved (no baseline)')
  parser.add_argument('--learner', action='store_true',
                      help='a learner thread trains beside the actor on the '
                      'same device through every window (see above)')
  parser.add_argument('--rtt_ms', nargs='+', type=float, default=None,
                      help='the envs reach the server through a proxy that '
                      'adds each of these round trips (bench/hosts/delay_proxy.py;'
                      ' 0: the proxy alone), in turn on the same fleet; tcp '
                      'only')
  parser.add_argument('--out', default=None, help='write the records as JSON')
  parser.add_argument('--plot', default=None, help='write a PNG bar chart')
  args = parser.parse_args(argv)
  quick = args.quick
  if args.envs is None:
    args.envs = 8 if quick else 16
  if args.seconds is None:
    args.seconds = 3.0 if quick else 6.0
  if args.repeats is None:
    args.repeats = 1 if quick else 2
  if args.warmup is None:
    args.warmup = 1.0 if quick else 2.0
  if args.envs < 2:
    parser.error('--envs must be >= 2')
  if args.rtt_ms and args.transports != ['tcp']:
    parser.error('--rtt_ms delays TCP only: pass --transports tcp')
  if args.repeats < 1 or args.seconds <= 0 or args.warmup < 0:
    parser.error('need --repeats >= 1, --seconds > 0 and --warmup >= 0')
  # The baseline first, as the ratios refer to it.
  args.modes = [m for m in MODES if m in args.modes]
  args.fleets = [f for f in FLEETS if f in args.fleets]
  return args


def _wait_for_quiet(threshold, timeout=900.0):
  """Waits until the 1-minute load average is below `threshold` (other
  work on a shared machine skews every number), at most `timeout` s."""
  start = time.monotonic()
  if os.getloadavg()[0] < threshold:
    return
  print(f'waiting for the load average ({os.getloadavg()[0]:.2f}) to fall '
        f'below {threshold:g}...', flush=True)
  while os.getloadavg()[0] >= threshold:
    if time.monotonic() - start > timeout:
      print(f'  still {os.getloadavg()[0]:.2f} after {timeout:.0f} s; '
            'going on.', flush=True)
      return
    time.sleep(5.0)
  print(f'  waited {time.monotonic() - start:.0f} s.', flush=True)


def main(argv=None):
  args = parse_args(argv)
  # SIGTERM unwinds like Ctrl-C, so every finally block stops its children.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
  start = time.monotonic()
  print(f'load average {os.getloadavg()[0]:.2f}; '
        f'actor_bench: {args.envs} envs, {args.step_time * 1000:.0f} ms '
        f'steps, {args.repeats} x {args.seconds:g} s windows per mode, policy '
        f'{args.size}, '
        f'{os.cpu_count()} CPU cores', flush=True)
  import portal
  from dreamer_ver.rpc.addresses import free_port
  portal.setup(host='127.0.0.1')  # the baseline binds loopback only
  # The baseline's batcher process dies with this process, even on SIGKILL.
  portal.initfn(die_with_parent, call_now=False)
  actors, records = {}, []
  for name in args.fleets:
    if args.wait_load > 0:
      _wait_for_quiet(args.wait_load)
    for transport in args.transports:
      print(f'fleet {name} over {transport}:', flush=True)
      began = time.monotonic()
      records += run_fleet(name, args, actors, free_port(), transport)
      print(f'  ({time.monotonic() - began:.0f} s)', flush=True)
  # Rows without a baseline of their own (shm; fast_multi, see run_fleet)
  # compare with the tcp baseline of the same env, one env per process.
  baselines = {(r['fleet'], r['rtt_ms']): r['sps'] for r in records
               if r['mode'] == 'baseline'}
  for record in records:
    of = 'fast' if record['fleet'] == 'fast_multi' else record['fleet']
    base = baselines.get((of, record['rtt_ms']))
    if record['ratio_baseline'] is None and base:
      record['ratio_baseline'] = record['sps'] / base
      record['baseline_of'] = f'{of} over tcp'
  print()
  print(table(records))
  if args.wal:
    print()
    print(wal_table(records))
  if args.learner:
    print()
    print(learner_table(records))
  if args.rtt_ms:
    print()
    print(latency_table(records))
  print(f'\n{time.monotonic() - start:.0f} s in all.')
  if args.out:
    stamp.write(args.out, records)
    print(f'Wrote {args.out}.')
  if args.plot:
    plot(records, args.plot)
  return 0


if __name__ == '__main__':
  sys.exit(main())
