"""Chaos soak: a parallel run whose components keep getting killed, stopped
and flooded.

Runs `python -m dreamer_ver.main --script parallel` on the `debug` config
with the `synthetic_tagged` task (every step is named by its env's seed, the
env process's pid and a serial number; every episode by an id, see
envs/synthetic.py) for `--minutes` (counted from the first env step). Every
20-40 s (`--kill_every LOW HIGH`) it hits one component -- an env process,
the replay server, the logger server or the agent, in shuffled rounds so each
kind is hit equally often -- with one of the `--faults`:

  kill   SIGKILL
  stop   SIGSTOP for 30-120 s (`--stop_for`), then SIGCONT: a hang. The
         run's `run.peer_timeout` is `--peer_timeout` (60 s): a stopped
         server is reported by its supervisor after a sixth of it and
         killed and restarted after all of it; an env process is nobody's
         server (the actor cuts its batches without it)
  flood  200 connections that never send a handshake to the component's
         server (replay, logger, actor; an env process has none), held
         for 30 s

or with a storage fault, each of which ends a life of the run (the same
command then starts the next, as a user would; bench/soaks/faults.py):

  fill     the logdir's file system filled to the last byte (`--disk_mb`:
           the logdir is a tmpfs of that size, root), then freed once the
           run stopped itself (exit code 2, at most 3 lines naming the
           full disk, no traceback)
  corrupt  the run stopped with SIGTERM, a byte of its latest agent
           checkpoint flipped (the newest keep-N copy is the same file),
           then started again: it must say which save it skipped and
           resume from an older one

Then it stops the run with SIGTERM and checks what the run left on disk:

  steps       env steps the logger counted (ckpt/logger.json)
  restarts    per component kind, processes that replaced a killed one (pid
              files in logdir/pids)
  exit        the run exits 0 after SIGTERM and leaves no child running
  lost rows   stored train rows (the replay's chunk files after the final
              save) of one env process whose serials skip a number inside an
              episode: a row the replay acknowledged and then lost (or a row
              in flight that was never resent). A killed agent or env ends
              its envs' episodes (they restart with is_first), so the rows
              it had not shipped yet never leave a hole.
  duplicated  stored train rows whose (seed, pid, serial) appears twice
  carries     pairs of consecutive stored rows of one env (not an episode
              start) whose second latent is not what the policy computes
              from the first row's latent and action: the actor gave that env
              another env's carry. The run uses `agent.opt.lr 0`, so the
              params in the final checkpoint are the ones every step used, and
              `replay_context 0`, so the learner writes no latents back over
              the actor's: the soak recomputes each step's deterministic
              state from the stored rows.
  episodes    logged episodes (scores.jsonl) whose id appears twice, or
              whose length is not the episode length (a hole)
  idle        the longest time no train row was stored (by row times)
  unreported  stops of a server longer than a sixth of run.peer_timeout
              that no line of the run's output names (its supervisor's
              heartbeat report)

  storage    per storage fault: the exit code and seconds of the stop, the
             fault's lines and tracebacks, and the restart's resume

  python -m bench.soaks.chaos --minutes 10 --out chaos.json
  python -m bench.soaks.chaos --minutes 10 --faults kill fill corrupt --disk_mb 512
"""

import argparse
import collections
import contextlib
import random
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench import stamp
from bench.soaks import faults as faultlib
from bench.soaks import watch

ROOT = Path(__file__).resolve().parents[2]
FAULTS = ('kill', 'stop', 'flood')
STORAGE = {'fill': 'disk', 'corrupt': 'checkpoint'}  # fault -> what it hits
SERVES = {'replay': 'run.replay_addr', 'logger': 'run.logger_addr',
          'agent': 'run.actor_addr'}
FLOOD = 200  # connections that never handshake
FLOOD_SECONDS = 30
SHUTDOWN_BUDGET = 60  # The runtime's 15 s per stop group plus the saves.


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  faultlib.soak_arguments(parser)
  parser.add_argument('--kill_every', type=float, nargs=2, default=(20, 40))
  parser.add_argument('--length', type=int, default=50)
  parser.add_argument('--faults', nargs='+', default=None,
                      help=f'of {" ".join(FAULTS)} (all); with --hosts of '
                      'kill stop partition oneway vanish (all)')
  parser.add_argument('--stop_for', type=float, nargs=2, default=(30, 120))
  parser.add_argument('--peer_timeout', type=float, default=60.0)
  parser.add_argument('--disk_mb', type=int, default=0,
                      help='the logdir on a tmpfs of this size (root); '
                      'needed by the fill fault')
  parser.add_argument('--hosts', action='store_true',
                      help='a split launch across network namespaces, with '
                      'partitions, one-way loss and vanishing hosts '
                      '(bench/soaks/chaos_hosts.py; root and iproute2); its '
                      'faults are kill stop partition oneway vanish')
  args = parser.parse_args()
  if args.hosts:
    from bench.soaks import chaos_hosts
  known = chaos_hosts.HOST_FAULTS if args.hosts else (*FAULTS, *STORAGE)
  args.faults = args.faults or list(chaos_hosts.HOST_FAULTS if args.hosts
                                    else FAULTS)
  if set(args.faults) - set(known):
    parser.error(f'--faults: choose from {" ".join(known)}')
  if 'fill' in args.faults and not args.disk_mb:
    parser.error('--faults fill needs --disk_mb (a file system to fill)')
  logdir = Path(args.logdir or tempfile.mkdtemp(prefix='chaos_'))
  disk = (faultlib.mounted(logdir, args.disk_mb) if args.disk_mb
          else contextlib.nullcontext())
  if args.hosts:
    report = chaos_hosts.chaos_hosts(
        logdir, args.minutes, args.kill_every, args.envs, args.length,
        args.step_time, args.seed, args.startup, args.faults, args.stop_for)
    print(chaos_hosts.format_report(report), flush=True)
  else:
    with disk:
      report = chaos(logdir, args.minutes, args.kill_every, args.envs,
                     args.length, args.step_time, args.seed, args.startup,
                     args.faults, args.stop_for, args.peer_timeout)
    print(format_report(report), flush=True)
  if args.out:
    stamp.write(args.out, report, indent=2)
  return 0 if report['ok'] else 1


def chaos(logdir, minutes, kill_every, envs=4, length=50, step_time=0.01,
          seed=0, startup=600.0, faults=('kill',), stop_for=(30, 120),
          peer_timeout=60.0):
  """Runs the soak; returns the report (a dict; `ok` says if it passed)."""
  rng = random.Random(seed)
  from dreamer_ver.rpc.addresses import free_port
  addrs = {key: f'127.0.0.1:{free_port()}' for key in SERVES.values()}
  flags = {**addrs, 'run.peer_timeout': peer_timeout,
      'configs': 'debug', 'task': 'synthetic_tagged', 'logdir': str(logdir),
      'run.steps': '1e9', 'run.envs': envs, 'run.eval_envs': 1,
      'env.synthetic.length': length, 'env.synthetic.step_time': step_time,
      'agent.opt.lr': 0, 'replay_context': 0, 'replay.size': '1e7',
      'run.log_every': 2,
      'run.save_every': 10}
  command = [sys.executable, '-m', 'dreamer_ver.main', '--script', 'parallel']
  for key, value in flags.items():
    command += [f'--{key}', str(value)]
  logdir.mkdir(parents=True, exist_ok=True)
  run = faultlib.Run(command, logdir, startup, SHUTDOWN_BUDGET)
  report = {'command': ' '.join(command), 'logdir': str(logdir),
            'minutes': minutes, 'kill_every': list(kill_every),
            'faults': list(faults), 'stop_for': list(stop_for),
            'peer_timeout': peer_timeout}
  kills, seen = [], collections.defaultdict(set)  # kind -> pids seen
  plan = [(kind, fault) for kind in faultlib.KINDS for fault in faults
          if fault in FAULTS and not (kind == 'env' and fault == 'flood')]
  plan += [(STORAGE[fault], fault) for fault in faults if fault in STORAGE]
  hits = {'kill': faultlib.kill, 'stop': faultlib.stop, 'flood': _flood,
          'fill': faultlib.fill_and_free,
          'corrupt': faultlib.corrupt_and_resume}
  try:
    run.start('first')
    start = time.monotonic()
    deadline = start + minutes * 60
    order = []
    next_kill = start + rng.uniform(*kill_every)
    while time.monotonic() < deadline:
      if run.proc.poll() is not None:
        raise RuntimeError(f'the run exited early with {run.proc.returncode}')
      for name, pid in watch.pids(logdir).items():
        seen[faultlib.kind_of(name)].add(pid)
      now = time.monotonic()
      if now >= next_kill and now < deadline - faultlib.QUIET_END:
        order = order or rng.sample(plan, len(plan))
        kind, fault = order.pop()
        kills.append(hits[fault](logdir, kind, rng, now - start,
                                 stop_for=stop_for, addrs=addrs, run=run))
        next_kill = time.monotonic() + rng.uniform(*kill_every)
      time.sleep(0.5)
    for name, pid in watch.pids(logdir).items():
      seen[faultlib.kind_of(name)].add(pid)
    for hit in kills:  # A stop that outlasted the soak ends before SIGTERM.
      if hit.get('resume') is not None:
        hit['resume'].join()
    stop_at = time.monotonic()
    code = run.stop()
    report['shutdown_s'] = round(time.monotonic() - stop_at, 1)
  finally:
    run.close()
  leftover = [name for name, pid in watch.pids(logdir).items() if watch.alive(pid)]
  for hit in kills:
    hit.pop('resume', None)
  killed = collections.Counter(
      k['kind'] for k in kills if k['pid'] and k['fault'] == 'kill')
  output = Path(run.log.name).read_text(errors='replace')
  envs_started = len(seen['env'])
  storage = [k for k in kills if k['fault'] in STORAGE]
  report.update({
      'exit_code': code, 'left_running': leftover, 'kills': kills,
      'killed': dict(killed), 'lives': run.lives,
      # A kill is followed by a new process of its kind; each life starts
      # one of each kind (envs: one per env process) that replaced none, so
      # the restarts are the pids beyond those.
      'restarts': {kind: len(seen[kind]) - run.lives * (
          len([n for n in watch.pids(logdir) if faultlib.kind_of(n) == 'env'])
          if kind == 'env' else 1) for kind in faultlib.KINDS},
      'env_processes_seen': envs_started,
      'faults_done': dict(collections.Counter(
          f"{k['kind']} {k['fault']}" for k in kills
          if k['pid'] or k.get('connections') or k['fault'] in STORAGE)),
      'storage_faults_handled': sum(k['ok'] for k in storage),
      'storage_faults_mishandled': [k for k in storage if not k['ok']],
      'unreported_stops': faultlib.unreported(kills, output, peer_timeout),
      'steps': watch.read_json(logdir / 'ckpt' / 'logger.json').get('step', 0)})
  report.update(faultlib.check_rows(logdir, length))
  report['ok'] = bool(
      code == 0 and not leftover and report['lost_rows'] == 0 and
      report['duplicated_rows'] == 0 and report['carries_mixed'] == 0 and
      report['episodes_twice'] == 0 and report['episodes_with_holes'] == 0
      and not report['unreported_stops']
      and not report['storage_faults_mishandled']
      # at most the line each full disk cut
      and report['score_lines_cut'] <= report['faults_done'].get(
          'disk fill', 0)
      and all(report['restarts'][k] >= killed[k] for k in killed))
  return report


def _flood(logdir, kind, rng, at, addrs, **_):
  """Opens FLOOD connections to the server of `kind` that never send their
  handshake, and closes them after FLOOD_SECONDS (on a thread)."""
  host, port = addrs[SERVES[kind]].rsplit(':', 1)
  socks = []
  for _ in range(FLOOD):
    try:
      socks.append(socket.create_connection((host, int(port)), timeout=2))
    except OSError:
      break  # Refused (restarting) or the backlog is full: enough.

  def close():
    time.sleep(FLOOD_SECONDS)
    for sock in socks:
      sock.close()
  resume = threading.Thread(target=close, daemon=True)
  resume.start()
  return {'t': round(at, 1), 'kind': kind, 'fault': 'flood', 'name': kind,
          'pid': None, 'connections': len(socks), 'resume': resume}


def format_report(report):
  lines = [f"chaos soak: {'PASS' if report['ok'] else 'FAIL'} "
           f"({report['minutes']} min, a fault every "
           f"{report['kill_every'][0]:g}-{report['kill_every'][1]:g} s)"]
  for key in ('steps', 'faults_done', 'killed', 'restarts', 'lives',
              'storage_faults_handled', 'storage_faults_mishandled',
              'unreported_stops', 'exit_code', 'shutdown_s',
              'left_running', 'stored_rows', 'lost_rows', 'duplicated_rows',
              'checked_carries', 'carries_mixed', 'episodes_logged',
              'score_lines_cut', 'episodes_twice', 'episodes_with_holes',
              'longest_idle_s'):
    lines.append(f'  {key:20} {report.get(key)}')
  return '\n'.join(lines)


if __name__ == '__main__':
  sys.exit(main())
