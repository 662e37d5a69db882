"""CPU used by an RPC server process: portal.Server vs our rpc_server.Server.

Each server runs in its own process with two methods, `echo` (returns its
argument) and `cpu` (the process's CPU seconds so far), one client
connected, as the replay and logger servers run. Two phases per server:

  idle   no calls for `--seconds`
  load   `--rate` calls per second of a dict of small arrays (a logger's
         metrics, a replay update), for `--seconds`

Prints cores used (CPU seconds / wall seconds) per server and phase, and the
ratio ours / portal. Servers alternate, `--rounds` times, so drifts in the
machine's load hit both alike.

  .venv/bin/python -m bench.actor.server_cpu --seconds 10 --rounds 2 --out FILE
"""

import argparse
import multiprocessing
import sys
import time

import numpy as np

from bench import stamp


def serve(kind, port, ready):
  import portal

  from dreamer_ver.rpc.server import Server

  if kind == 'portal':
    server = portal.Server(port, 'Portal', host='127.0.0.1', errors=False,
                           logging=False)
  else:
    server = Server(f'127.0.0.1:{port}', 'Ours', logging=False)
  server.bind('echo', lambda x: x, workers=1)
  server.bind('cpu', time.process_time, workers=1)
  if kind == 'portal':
    server.start(block=False)
  else:
    server.start()
  ready.set()
  time.sleep(1e6)


def measure(kind, seconds, rate):
  """{phase: cores used} for one server process."""
  from dreamer_ver.rpc.client import Client
  from dreamer_ver.rpc.addresses import free_port

  port = free_port()
  context = multiprocessing.get_context('spawn')
  ready = context.Event()
  proc = context.Process(target=serve, args=(kind, port, ready), daemon=True)
  proc.start()
  client = Client(f'127.0.0.1:{port}', 'Bench', maxinflight=4)
  payload = {f'metric/{i}': np.float64(i) for i in range(32)}
  result = {}
  try:
    assert ready.wait(60), 'server did not start'
    client.cpu().result(timeout=30)
    time.sleep(1.0)  # Let the start-up settle.
    for phase in ('idle', 'load'):
      cpu, start = client.cpu().result(timeout=30), time.monotonic()
      end = start + seconds
      calls = 0
      while (now := time.monotonic()) < end:
        if phase == 'load':
          client.echo(payload).result(timeout=30)
          calls += 1
          time.sleep(max(0.0, start + calls / rate - time.monotonic()))
        else:
          time.sleep(min(0.5, end - now))
      used = client.cpu().result(timeout=30) - cpu
      result[phase] = float(used / (time.monotonic() - start))
  finally:
    client.close(timeout=2)
    proc.kill()
    proc.join()
  return result


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--seconds', type=float, default=10.0)
  parser.add_argument('--rate', type=float, default=50.0)
  parser.add_argument('--rounds', type=int, default=2)
  parser.add_argument('--out', default='')
  args = parser.parse_args()
  runs = {'portal': [], 'ours': []}
  for round_ in range(args.rounds):
    for kind in runs:
      runs[kind].append(measure(kind, args.seconds, args.rate))
      cores = ', '.join(f'{k} {v:.4f}' for k, v in runs[kind][-1].items())
      print(f'round {round_} {kind}: cores used {cores}', flush=True)
  table = {kind: {phase: float(np.mean([r[phase] for r in results]))
                  for phase in ('idle', 'load')}
           for kind, results in runs.items()}
  print(f'\ncores used by the server process ({args.seconds:g} s per phase, '
        f'{args.rounds} rounds, load = {args.rate:g} calls/s)')
  print('| phase | portal.Server | ours | ours / portal |')
  print('| --- | ---: | ---: | ---: |')
  for phase in ('idle', 'load'):
    theirs, ours = table['portal'][phase], table['ours'][phase]
    print(f'| {phase} | {theirs:.3f} | {ours:.4f} | {ours / theirs:.3f} |')
  if args.out:
    stamp.write(args.out, {'args': vars(args), 'runs': runs, 'mean': table})
  return 0


if __name__ == '__main__':
  sys.exit(main())
