"""One command for a GPU window: the stack, the GPU-relevant tests, actor
serving, the learner and a learning run, each stage bounded, results into
one folder as JSON, logs and a markdown report.

  python -m bench.gpu.gpu --out DIR [--stages stack tests ...] [--smoke]
  python -m bench.gpu.gpu --report DIR [DIR ...]   (one report of several runs)

On a GPU machine without network, `bench/gpu/gpu.sh` installs the carried
wheels (`bench/gpu/gpu_wheels.py`) first and then runs this. Stages, in order
(measurements first: the tests compile for minutes on a GPU):

  stack     GPU name, memory and driver (nvidia-smi), Python and the
            versions of jax, jaxlib, flax, optax, numpy, `jax.devices()`
  learner   updates/s of size12m bfloat16's base update and of its
            scans unrolled by 16, under XLA flags that take whole while
            loops into CUDA graphs (`XLA_FLAGS` per command, so each is its
            own process), then under XLA's defaults beside upstream
            DreamerV3 where `--upstream` names its source, with the top
            ops of a traced update; size1m's in float32 and bfloat16
            beside upstream (`learner_bench.py`, without the matmul floor:
            one compile per product is minutes on a GPU)
  e2e       the whole system beside upstream DreamerV3's own parallel
            script (`--upstream`): dmc_walker_walk, 16 envs, 3.5 minutes
            each (`e2e.py`)
  overhead  per-batch host overhead of the actor against the bare jitted
            step at each padded bucket, and its stages with the real and a
            null policy, then size12m's stages again with the policy step
            in CUDA graphs (`overhead_bench.py`, `--stages`, XLA_FLAGS)
  actor     the actor bench's `fast` fleet (dm_control cartpole, about
            0.2 ms a step, so the runtime's own cost shows) at 16, 64 and
            256 envs, tcp and shm, portal's fixed batch vs `ver` and
            `preempt` (`actor_bench.py`)
  shared    a learner thread training beside the actor in its process,
            the actor serving 16 and 64 fast envs over tcp with `ver`:
            the learner's updates/s against its own alone
            (`actor_bench.py --learner`)
  tests     the GPU-relevant tests with JAX's default backend (the GPU),
            one pytest per file, all at once, so that a slow file keeps
            the others' reports: agent, data-parallel, devices, recompile;
            what a test records (bf16 against f32) comes into the report
  learning  `--script parallel --configs dmc_proprio` for
            `--learning_minutes`, its scores against DreamerV3's published
            runs at the same steps (`dreamer_ver.logger.plot --table`)

Each stage is a child process with a deadline (a hung stage costs its own
time, not the window's). `--out` gets three files, rewritten after every
stage so that a window cut short keeps what it finished: `gpu.json` (each
stage's commands, exit codes, seconds and results), `gpu.md` (the report)
and `gpu.log` (every command's output); the learning stage adds its
`scores.jsonl`. Few files, since a GPU machine may send back only a few.
`--smoke` runs every stage tiny on the CPU (the debug model; 8 minutes on
a 2-core AMD EPYC); a test runs it, so the command cannot rot.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.gpu.gpu_report import report

ROOT = Path(__file__).resolve().parents[2]
STAGES = ('stack', 'learner', 'e2e', 'overhead', 'actor', 'shared',
          'tests', 'learning')
TESTS = ('tests/agent/test_agent.py', 'tests/agent/test_agent_upstream.py',
         'tests/system/test_data_parallel.py', 'tests/actor/test_recompile.py',
         'tests/cluster/test_devices.py')
ACTOR_ENVS = (16, 64, 256)
SHARED_ENVS = (16, 64)
# XLA:GPU options that may cut the gaps between the update's many small
# kernels, each run as its own learner_bench process: command buffers (CUDA
# graphs) on by default cover fusions and library calls but not the scans'
# while loops, whose every trip goes back to the host. XLA aborts on a
# flag it does not know: that command fails alone.
XLA_FLAG_SETS = {
    'cmdbuf_while': '--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,'
                    'CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE '
                    '--xla_gpu_graph_min_graph_size=1',
}

STACK = r'''
import json, platform, subprocess, sys
import jax, jaxlib, flax, optax, numpy
try:
  smi = subprocess.run(
      ['nvidia-smi', '--query-gpu=name,memory.total,driver_version',
       '--format=csv,noheader'], capture_output=True, text=True,
      timeout=30).stdout.strip()
except (OSError, subprocess.TimeoutExpired):
  smi = ''
json.dump({
    'python': platform.python_version(), 'machine': platform.machine(),
    'cpus': __import__('os').cpu_count(), 'nvidia_smi': smi,
    'jax': jax.__version__, 'jaxlib': jaxlib.__version__,
    'flax': flax.__version__, 'optax': optax.__version__,
    'numpy': numpy.__version__, 'backend': jax.default_backend(),
    'devices': [str(d) for d in jax.devices()],
    'device_kind': jax.devices()[0].device_kind,
}, open(sys.argv[1], 'w'), indent=1)
'''


def stage_commands(stage, args, out):
  """[(command, seconds[, environment variables])] that write the stage's
  results into `out`."""
  py = [sys.executable]
  smoke = args.smoke
  if stage == 'stack':
    return [(py + ['-c', STACK, str(out / 'stack.json')], 120)]
  if stage == 'tests':
    if smoke:  # the one test that records properties
      return [(py + ['-m', 'pytest', '-q', '-p', 'no:cacheprovider',
                     '-o', 'junit_family=xunit1',
                     f'--junitxml={out}/tests_0.xml', '-k', 'bfloat16',
                     'tests/agent/test_agent_upstream.py'], 120)]
    # At once on an H200 the agent's two files took 190-220 s, the
    # others under 60 (their compiles). xunit1 keeps recorded properties.
    return [(py + ['-m', 'pytest', '-q', '--tb=short', '-rf',
                   '-p', 'no:cacheprovider', '-o', 'junit_family=xunit1',
                   f'--junitxml={out}/tests_{i}.xml', path], 300)
            for i, path in enumerate(TESTS)]
  if stage == 'overhead':
    sizes = ['debug'] if smoke else ['size1m', 'size12m']
    bench = py + ['-m', 'bench.actor.overhead_bench',
                  '--envs', '4' if smoke else '256',
                  '--repeats', '3' if smoke else '30']
    seconds = 120 if smoke else 200
    commands = [
        (bench + ['--sizes', *sizes, '--out', str(out / 'overhead.json')],
         seconds),
        (bench + ['--sizes', *sizes, '--stages',
                  '--out', str(out / 'overhead_stages.json')], seconds)]
    if not smoke:  # The policy step's kernels launched as CUDA graphs: on
      # an H100 its dispatch took 0.55-0.64 ms, flat in rows, against
      # 0.25-0.33 ms for a null policy's few kernels.
      commands.append((bench + [
          '--sizes', 'size12m', '--stages',
          '--out', str(out / 'overhead_stages_cmdbuf.json')], 150,
                       {'XLA_FLAGS': XLA_FLAG_SETS['cmdbuf_while']}))
    return commands
  if stage in ('actor', 'shared'):
    commands = []
    envs_list = [2] if smoke else (
        args.actor_envs or (ACTOR_ENVS if stage == 'actor' else SHARED_ENVS))
    modes, transports = (['baseline', 'ver', 'preempt'], ['tcp', 'shm'])
    size = 'debug' if smoke else 'size12m'
    if stage == 'shared':
      modes, transports = ['ver'], ['tcp']
    for envs in envs_list:
      commands.append((py + [
          '-m', 'bench.actor.actor_bench', '--fleets', 'fast',
          '--modes', *modes, '--transports', *transports,
          '--envs', str(envs), '--size', size,
          '--seconds', '1' if smoke else '5', '--warmup',
          '0.5' if smoke else '2', '--repeats', '1',
          *(['--learner'] if stage == 'shared' else []),
          '--out', str(out / f'{stage}_{envs}.json')],
          180 if smoke else 300))
    return commands
  if stage == 'learner':
    return learner_commands(args, out)
  if stage == 'e2e':  # both systems' parallel scripts, 3.5 minutes each
    command = py + ['-m', 'bench.system.e2e', '--out', str(out / 'e2e.json')]
    if args.upstream:
      command += ['--upstream', args.upstream]
      command += ['--site', args.upstream_site] if args.upstream_site else []
    if smoke:
      return [(command + ['--smoke'], 240)]
    return [(command + [
        '--tasks', 'dmc_walker_walk', '--envs', '16', '--minutes', '3.5',
        '--rounds', '1', '--platform', 'cuda', '--dtype', 'bfloat16'], 480)]
  if stage == 'learning':
    seconds = args.learning_minutes * 60
    configs = ['debug'] if smoke else ['dmc_proprio']
    command = py + ['-m', 'dreamer_ver.main', '--script', 'parallel',
                    '--configs', *configs, '--logdir', str(args.logdir),
                    '--run.duration', str(seconds)]
    if smoke:  # short episodes, so that some end in half a minute
      command += ['--task', 'dummy_cont', '--env.dummy.length', '20',
                  '--run.envs', '2']
    return [(command, seconds + 240)]
  raise ValueError(stage)


def learner_commands(args, out):
  """learner_bench commands, the likeliest win first (a GPU compiles each
  configuration for one to two minutes, so a window cut short keeps the
  first ones). On an H200 size12m bfloat16's update kept the device busy
  25.5 of its 27 ms in thousands of tiny kernels, the scans' steps, and 8
  updates fused in one call changed nothing (0.99x): the levers left are
  the ones that cut the scans' per-step cost. So: size12m bfloat16's base
  and fully unrolled-by-16 scans under the command-buffer flags that take
  whole while loops into CUDA graphs; the same two under XLA's defaults
  beside upstream, with the op profile; size1m in both dtypes beside
  upstream. Each writes its JSON after every round and prints each
  compile's time."""
  bench = [sys.executable, '-m', 'bench.learner.learner_bench', '--no-floor']
  upstream = ['--upstream', args.upstream] if args.upstream else []
  if args.upstream and args.upstream_site:
    upstream += ['--upstream_site', args.upstream_site]
  if args.smoke:  # tiny, on the CPU: every kind of command once
    shape = ['--batch', '2', '--length', '4', '--steps', '2', '--rounds', '1']
    big, small, dtypes = 'debug', 'debug', ['float32']
    # The flag-set command with the flags it was given: XLA's own
    # defaults would compile everything again (40 s more on a 2-core CPU).
    flags = os.environ.get('XLA_FLAGS', '')
    variants, seconds = ['base', 'unroll2'], (120,) * 3
  else:
    shape = ['--steps', '8', '--rounds', '3']
    big, small, dtypes = 'size12m', 'size1m', ['float32', 'bfloat16']
    flags = XLA_FLAG_SETS['cmdbuf_while']
    variants, seconds = ['base', 'unroll16'], (180, 180, 200)

  def learner(name, size, dtypes, more, limit, environ=None):
    command = bench + shape + ['--sizes', size, '--dtypes', *dtypes,
                               '--variants', *variants, *more,
                               '--out', str(out / f'learner_{name}.json')]
    return (command, limit) + ((environ,) if environ is not None else ())

  return [
      learner('cmdbuf_while', big, dtypes[-1:], [], seconds[0],
              {'XLA_FLAGS': flags}),
      learner('upstream', big, dtypes[-1:], ['--profile', *upstream],
              seconds[1]),
      learner('small', small, dtypes, upstream, seconds[2])]


def run_stage(stage, args, out, work):
  """Runs a stage's commands under their deadlines (their files go to
  `work`, their output to `out/gpu.log`); returns its record. The tests'
  files run at once on the GPU: each compiles for minutes on its own CPU
  core, and none allocates the GPU's memory up front."""
  record = {'stage': stage, 'commands': [], 'ok': True}
  env = dict(os.environ)
  if not args.smoke:
    env['JAX_PLATFORMS'] = ''  # JAX's default backend: the GPU
  else:  # the learner's commands share their compiles, as on a rerun
    env.setdefault('JAX_COMPILATION_CACHE_DIR', str(work / 'jax_cache'))
  together = stage == 'tests' and not args.smoke
  if together:
    env['XLA_PYTHON_CLIENT_PREALLOCATE'] = 'false'
  start = time.monotonic()
  commands = stage_commands(stage, args, work)
  batches = [commands] if together else [[c] for c in commands]
  for batch in batches:
    running = [launch(stage, i, command, env, work, args.window_end)
               for i, command in enumerate(batch)]
    for run in running:
      record['commands'].append(finish(run, out / 'gpu.log'))
      record['ok'] &= record['commands'][-1]['exit'] == 0
  record['seconds'] = round(time.monotonic() - start)
  record['results'] = collect(stage, args, work)
  return record


def launch(stage, index, command, env, work, window_end):
  """Starts one (command, seconds[, variables]) in its own session, its
  output into its own log in `work`; its deadline is the earlier of its
  own and the window's end."""
  argv, seconds, *more = command
  seconds = max(0.0, min(seconds, window_end - time.monotonic()))
  variables = more[0] if more else {}  # a command's own (XLA_FLAGS)
  shown = ' '.join([f'{k}={v}' for k, v in variables.items()] + [
      c if len(c) < 200 else '<script>' for c in argv])
  log = work / f'{stage}_{index}.log'
  with open(log, 'w') as file:
    proc = subprocess.Popen(argv, cwd=ROOT, env={**env, **variables},
                            stdout=file, stderr=subprocess.STDOUT,
                            start_new_session=True)
  return {'proc': proc, 'shown': shown, 'log': log, 'stage': stage,
          'deadline': time.monotonic() + seconds, 'seconds': seconds,
          'began': time.monotonic()}


def finish(run, gpu_log):
  """Waits for a launched command until its deadline (then stops its
  process group), appends its output to `gpu_log`; returns its record."""
  proc = run['proc']
  try:
    code = proc.wait(timeout=max(0.0, run['deadline'] - time.monotonic()))
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, 15)
    try:
      proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, 9)
      proc.wait()
    code = f"timeout after {run['seconds']:.0f} s"
  with open(gpu_log, 'a') as log:
    print(f"[{run['stage']}] {run['shown']}", file=log)
    log.write(run['log'].read_text(errors='replace'))
  return {'command': run['shown'], 'exit': code,
          'seconds': round(time.monotonic() - run['began'])}


def collect(stage, args, out):
  """The stage's results, read back from the files its commands wrote."""
  if stage == 'tests':
    counts = dict.fromkeys(('tests', 'failures', 'errors', 'skipped'), 0)
    for xml in sorted(out.glob('tests_*.xml')):
      head = re.search(r'<testsuite [^>]*>', xml.read_text())
      found = dict(re.findall(r'(\w+)="([^"]*)"', head.group(0)))
      for key in counts:
        counts[key] += int(found.get(key, 0))
    counts['files'] = len(list(out.glob('tests_*.xml')))
    counts['properties'] = {  # what a test recorded (record_property)
        test: dict(re.findall(r'<property name="([^"]*)" value="([^"]*)"',
                              body))
        for xml in sorted(out.glob('tests_*.xml'))
        for test, body in re.findall(
            r'<testcase [^>]*name="([^"]*)"[^>]*>(.*?)</testcase>',
            xml.read_text(), re.S) if '<property' in body}
    return counts
  if stage in ('actor', 'shared'):
    rows = []
    for path in sorted(out.glob(f'{stage}_*.json')):
      for r in json.loads(path.read_text())['records']:
        rows.append({k: r.get(k) for k in (
            'fleet', 'envs', 'transport', 'mode', 'sps', 'ratio_baseline',
            'p50_ms', 'p99_ms', 'batch_mean', 'policy_ms_mean', 'cpu_server',
            'learner_ups', 'learner_alone_ups')})
    return rows
  if stage == 'learning':
    return learning_scores(args)
  if stage == 'overhead':
    return {name: json.loads(path.read_text())['records']
            if path.exists() else []
            for name, path in (
                ('host', out / 'overhead.json'),
                ('stages', out / 'overhead_stages.json'),
                ('stages_cmdbuf', out / 'overhead_stages_cmdbuf.json'))}
  if stage == 'learner':
    runs = {}
    for path in sorted(out.glob('learner_*.json')):
      runs[path.stem[len('learner_'):]] = json.loads(path.read_text())
    return runs
  path = out / f'{stage}.json'
  return json.loads(path.read_text()) if path.exists() else {}


def learning_scores(args):
  """Steps reached and the score table against the reference."""
  from dreamer_ver.logger.plot import load_scores
  if not (Path(args.logdir) / 'scores.jsonl').exists():
    return {}
  steps, _ = load_scores(args.logdir)
  last = int(max(steps, default=0))
  marks = [s for s in (5000, 10000, 20000, 50000, 100000, 200000, 500000)
           if s <= last] or [last]
  # The smoke run's dummy task has no reference: it reads walker's.
  task = ['--task', 'dmc_walker_walk'] if args.smoke else []
  table = subprocess.run(
      [sys.executable, '-m', 'dreamer_ver.logger.plot', str(args.logdir),
       '--reference', 'dmc_proprio', *task, '--table', *map(str, marks)],
      cwd=ROOT, capture_output=True, text=True, timeout=120)
  return {'episodes': len(steps), 'last_step': last,
          'table': table.stdout.strip() or table.stderr.strip()}


def commit(given=None):
  """`given` (--commit), else git's HEAD: a copied tree's git metadata can
  be older than its files."""
  return given or subprocess.run(
      ['git', 'rev-parse', '--short', 'HEAD'], cwd=ROOT, capture_output=True,
      text=True).stdout.strip() or '?'


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--out', help='folder for the results')
  parser.add_argument('--stages', nargs='+', default=list(STAGES),
                      choices=STAGES)
  parser.add_argument('--smoke', action='store_true',
                      help='every stage tiny, on the CPU')
  parser.add_argument('--learning_minutes', type=float, default=8.0)
  parser.add_argument('--minutes', type=float, default=float('inf'),
                      help="the window's length: a command still running "
                      '20 s before its end stops there, and the results '
                      'so far are written')
  parser.add_argument('--logdir', default='',
                      help="the learning run's logdir (a new temporary one)")
  parser.add_argument('--actor_envs', type=int, nargs='+',
                      help='fleet sizes of the actor and shared stages '
                      f'({ACTOR_ENVS} and {SHARED_ENVS})')
  parser.add_argument('--upstream', metavar='SRC',
                      help="time upstream DreamerV3's learner beside ours "
                      '(a danijar/dreamerv3 checkout; gpu_wheels.py carries '
                      'it as .upstream)')
  parser.add_argument('--upstream_site', metavar='DIR',
                      help="upstream's extra packages, where they are not "
                      'importable already (bench/upstream/upstream.py)')
  parser.add_argument('--commit', help="the tree's commit, where its git "
                      "metadata may be stale (default: git's HEAD)")
  parser.add_argument('--report', nargs='+', metavar='DIR',
                      help="print one report of these runs' gpu.json")
  args = parser.parse_args(argv)
  if args.report:
    records = [r for d in args.report
               for r in json.loads((Path(d) / 'gpu.json').read_text())]
    print(report(records))
    return 0
  if not args.out:
    parser.error('--out is required')
  out = Path(args.out).resolve()
  out.mkdir(parents=True, exist_ok=True)
  if args.smoke:
    os.environ['JAX_PLATFORMS'] = 'cpu'
    args.learning_minutes = min(args.learning_minutes, 0.25)
  args.logdir = args.logdir or tempfile.mkdtemp(prefix='gpu_learning_')
  work = Path(tempfile.mkdtemp(prefix='gpu_bench_'))
  args.window_end = time.monotonic() + args.minutes * 60 - 20
  records = []
  for stage in [s for s in STAGES if s in args.stages]:
    if time.monotonic() > args.window_end:
      print(f'{stage}: the window is over', flush=True)
      continue
    print(f'{stage}...', flush=True)
    record = run_stage(stage, args, out, work)
    record.update(commit=commit(args.commit),
                  date=time.strftime('%Y-%m-%d'))
    results = record.get('results')
    if args.commit and isinstance(results, dict) and 'commit' in results:
      results['commit'] = args.commit  # a bench's own, read from git
    records.append(record)
    print(f"  {'ok' if record['ok'] else 'FAILED'} in {record['seconds']} s",
          flush=True)
    (out / 'gpu.json').write_text(json.dumps(records, indent=1))
    (out / 'gpu.md').write_text(report(records))
  scores = Path(args.logdir) / 'scores.jsonl'
  if 'learning' in args.stages and scores.exists():
    shutil.copy(scores, out / 'scores.jsonl')
  shutil.rmtree(work, ignore_errors=True)
  print(report(records))
  return 0 if all(r['ok'] for r in records) else 1


if __name__ == '__main__':
  sys.exit(main())
