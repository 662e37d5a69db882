"""The fault soaks' shared primitives (bench/soaks/chaos.py, bench/soaks/chaos_hosts.py,
bench/soaks/soak.py): a run's processes hit by kind, the checks of what the run
stored, and the storage faults.

  KINDS, kind_of(name)            the components a soak hits; a pid file's
                                  kind
  soak_arguments(parser)          the flags every local soak takes
  pick, kill, stop                one running process of a kind: chosen,
                                  SIGKILLed, SIGSTOPped for a while
  unreported(hits, output, ...)   the long stops of a server no line names
  check_rows(logdir, length)      rows lost, duplicated, carries mixed,
                                  episodes twice or with holes (chaos.py's
                                  docstring says how each is counted)

Storage faults (`--faults fill corrupt`): a logdir on a file system of its
own, filled to the last byte and freed again, and an agent checkpoint
damaged between two lives of the run. Each ends a life of the run (`Run`);
the same command starts the next.

  mounted(directory, megabytes)   a tmpfs of that size at `directory`
                                  (root), unmounted on exit
  fill(directory) -> bytes        writes a ballast file until the file
                                  system is full
  free(directory)                 removes it
  damage_checkpoint(logdir)       flips a byte of the latest agent
                                  checkpoint's largest array, in place
  fill_and_free, corrupt_and_resume
                                  the soak's two faults, with their checks
  Run                             the soak's run, one life at a time
"""

import collections
import contextlib
import errno
import json
import os
import re
import signal
import struct
import subprocess
import threading
import time
import zipfile
from pathlib import Path

import numpy as np

from bench.soaks import watch

ROOT = Path(__file__).resolve().parents[2]
BALLAST = 'ballast'  # the filler's file name, in the filled folder
KINDS = ('env', 'replay', 'logger', 'agent')
QUIET_END = 20  # No kills in the last seconds: the killed come back first.


@contextlib.contextmanager
def mounted(directory, megabytes):
  """A tmpfs of `megabytes` at `directory` (created) while the context
  lasts. Needs root (mount); a clear RuntimeError otherwise."""
  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  done = subprocess.run(
      ['mount', '-t', 'tmpfs', '-o', f'size={int(megabytes)}m', 'tmpfs',
       str(directory)], capture_output=True, text=True)
  if done.returncode:
    raise RuntimeError(f'cannot mount a {megabytes} MB tmpfs at {directory} '
                       f'(root is needed): {done.stderr.strip()}')
  try:
    yield directory
  finally:
    subprocess.run(['umount', '-l', str(directory)], check=False)


def fill(directory):
  """Writes `directory/ballast` until the file system says it is full
  (ENOSPC), in blocks of 1 MB, then of 4 kB; returns the bytes written.
  Any other error is raised."""
  written = 0
  with open(Path(directory) / BALLAST, 'ab', buffering=0) as file:
    for size in (1 << 20, 4096):
      try:
        while True:
          written += file.write(b'\0' * size)
      except OSError as error:
        if error.errno != errno.ENOSPC:
          raise
  return written


def free(directory):
  """Removes what `fill` wrote."""
  with contextlib.suppress(FileNotFoundError):
    os.remove(Path(directory) / BALLAST)


def damage_checkpoint(logdir):
  """Flips a byte in the middle of the largest array of
  `logdir/ckpt/agent.npz`, in place (its hard-linked newest keep-N copy is
  the same file, so it is damaged too), as a disk does: that array's
  checksum no longer matches. (A byte of a zip's local header that readers
  skip would leave the save intact.) Returns the env step the damaged save
  was counted at."""
  path = Path(logdir) / 'ckpt' / 'agent.npz'
  steps = json.loads((path.parent / 'counters.json').read_text())['steps']
  with zipfile.ZipFile(path) as archive:
    member = max(archive.infolist(), key=lambda info: info.compress_size)
  with open(path, 'r+b') as file:
    file.seek(member.header_offset + 26)  # the local header's two lengths
    names, extra = struct.unpack('<HH', file.read(4))
    file.seek(names + extra + member.compress_size // 2, os.SEEK_CUR)
    byte = file.read(1)
    file.seek(-1, os.SEEK_CUR)
    file.write(bytes([byte[0] ^ 0xFF]))
  return steps


def fill_and_free(logdir, kind, rng, at, run, **_):
  """The soak's fill fault (`kind` names it in the report): fills the
  logdir's file system; the run must stop itself in order
  (exit code 2) and say so in a few lines, without a traceback. Then frees
  it and starts the next life, which must resume."""
  run.note('fill')
  filled = fill(logdir)
  began = time.monotonic()
  code = run.wait(extra=60)
  stop_s = time.monotonic() - began
  text = run.output('fill')
  lines = [l for l in text.splitlines() if re.search(
      r'no space left|Errno 28|ENOSPC', l, re.IGNORECASE)]
  hit = {'t': round(at, 1), 'kind': kind, 'fault': 'fill', 'name': kind,
         'pid': None, 'filled_mb': round(filled / 2 ** 20, 1),
         'exit_code': code, 'stop_s': round(stop_s, 1),
         'fault_lines': len(lines), 'tracebacks': text.count('Traceback'),
         'line': lines[0][:300] if lines else None}
  if code is None:
    run.kill()
  free(logdir)
  run.start('after the disk was freed')
  hit['ok'] = (code == 2 and 1 <= len(lines) <= 3
               and not hit['tracebacks'])
  return hit


def corrupt_and_resume(logdir, kind, rng, at, run, **_):
  """The soak's corrupt fault: stops the run, damages its latest agent
  checkpoint and starts the next life, which must skip that save with one
  line and resume from an older one. Not done before two saves exist
  (nothing older to resume)."""
  saved = Path(logdir) / 'ckpt' / 'saved'
  hit = {'t': round(at, 1), 'kind': kind, 'fault': 'corrupt',
         'name': kind, 'pid': None}
  if len([p for p in saved.glob('*') if p.name.isdigit()]) < 2:
    return {**hit, 'fault': 'corrupt (too early: one save)', 'ok': True}
  run.note('corrupt')
  code = run.stop()
  if code is None:  # one life at a time, children included
    run.kill()
  hit['stop_code'] = code
  hit['damaged_step'] = damage_checkpoint(logdir)
  run.start('after a damaged checkpoint')
  text = run.output('life')
  resumed = re.search(r'Agent resumed at step (\d+)', text)
  hit['resumed_step'] = int(resumed[1]) if resumed else None
  hit['skip_said'] = 'Skipped the unreadable checkpoint' in text
  hit['tracebacks'] = text.count('Traceback')
  hit['ok'] = bool(code == 0 and hit['skip_said'] and resumed and int(
      resumed[1]) < hit['damaged_step'] and not hit['tracebacks'])
  return hit


class Run:
  """The soak's run, one life at a time: a storage fault ends a life, and
  the same command starts the next. All lives write one output file, each
  after a line that names it, beside the logdir (`<logdir>.stdout.log`):
  on the file system the soak fills it would lose lines, and it outlives a
  logdir that is a mount of its own. Each life is a session of its own, so
  a life that does not stop is killed with its children."""

  def __init__(self, command, logdir, startup, shutdown):
    self.command = command
    self.startup = startup  # seconds a life may take to serve
    self.shutdown = shutdown  # seconds a life may take to stop
    self.log = open(f'{Path(logdir)}.stdout.log', 'w')
    self.env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'PYTHONUNBUFFERED': '1'}
    self.lives = 0
    self.proc = None

  def start(self, why):
    """Starts the next life; returns once it serves (the agent's first
    action, which follows its checkpoint's resume) or raises."""
    self.lives += 1
    self.note(f'life {self.lives} ({why})')
    self.proc = subprocess.Popen(self.command, cwd=ROOT, env=self.env,
                                 stdout=self.log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    if not watch.wait(lambda: 'First action served' in self.output(
        'life') or self.proc.poll() is not None, self.startup) or (
            self.proc.poll() is not None):
      raise RuntimeError(f'life {self.lives} of the run never served (see '
                         f'{self.log.name})')

  def note(self, what):
    """A line in the output: what the soak did, at this point."""
    self.log.write(f'=== chaos: {what} ===\n')
    self.log.flush()

  def output(self, since='life'):
    """The run's output after the last note starting with `since`."""
    text = Path(self.log.name).read_text(errors='replace')
    return text[text.rfind(f'=== chaos: {since}'):]

  def stop(self):
    """SIGTERM, as a user stops it; its exit code, None if it was still
    running after `shutdown` seconds."""
    self.proc.send_signal(signal.SIGTERM)
    return self.wait()

  def wait(self, extra=0):
    """Its exit code, None if it still runs after `shutdown` (plus
    `extra`) seconds."""
    try:
      return self.proc.wait(timeout=self.shutdown + extra)
    except subprocess.TimeoutExpired:
      return None

  def kill(self):
    """SIGKILL to the life's session: the run and every child it left."""
    with contextlib.suppress(ProcessLookupError):
      os.killpg(self.proc.pid, signal.SIGKILL)
    self.proc.wait()

  def close(self):
    """Kills a life still running; one that ended keeps whatever it left
    running, for the soak's check of what was left."""
    if self.proc is not None and self.proc.poll() is None:
      self.kill()
    self.log.close()


def soak_arguments(parser):
  """The flags every soak of a local run takes (chaos.py, soak.py): how
  long, how many envs at what step time, where, and the start-up budget."""
  parser.add_argument('--minutes', type=float, default=10.0)
  parser.add_argument('--envs', type=int, default=4)
  parser.add_argument('--step_time', type=float, default=0.01)
  parser.add_argument('--logdir', default='')
  parser.add_argument('--out', default='')
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--startup', type=float, default=600.0,
                      help='seconds to wait for the first env step')


def kind_of(name):
  """The kind of a process by its pid file's name: env0, env1, ... are envs."""
  return 'env' if name.startswith('env') else name


def unreported(hits, output, peer_timeout):
  """The stops of a server, long enough to be reported, that no line of the
  run's output names."""
  missed = []
  for hit in hits:
    if (hit['fault'] == 'stop' and hit['pid'] and hit['kind'] != 'env'
        and hit['seconds'] >= peer_timeout / 6 + 2):
      if f"{hit['name']} (pid {hit['pid']}) has answered no heartbeat" not in (
          output):
        missed.append(f"{hit['name']} pid {hit['pid']} at {hit['t']} s")
  return missed


def check_rows(logdir, length):
  """The stored-data checks of the module docstring."""
  rows = ordered_rows(logdir)
  tag = rows['tag']
  same_env = (tag[1:, :2] == tag[:-1, :2]).all(1)
  step = tag[1:, 2] - tag[:-1, 2]
  first = rows['is_first'][1:].astype(bool)
  duplicated = int((same_env & (step == 0)).sum())
  lost = int((same_env & (step > 1) & ~first).sum())
  pairs = carry_pairs(rows)
  mixed = carries_mixed(logdir, rows, pairs)
  times = np.sort(rows['time'])
  # A full disk may cut the line the logger was appending; the next one
  # starts on a line of its own and readers skip the cut one (as plot's
  # load_scores does): it is counted, not read.
  scores, cut = [], 0
  for line in (Path(logdir) / 'scores.jsonl').read_text().splitlines():
    try:
      scores.append(json.loads(line))
    except json.JSONDecodeError:
      cut += 1
  ids = collections.Counter(
      (s['env'], s['log/pid'], s['log/episode']) for s in scores)
  return {
      'stored_rows': int(len(tag)), 'lost_rows': lost,
      'duplicated_rows': duplicated, 'checked_carries': int(len(pairs)),
      'carries_mixed': mixed, 'episodes_logged': len(scores),
      'score_lines_cut': cut,
      'episodes_twice': sum(n - 1 for n in ids.values()),
      'episodes_with_holes': sum(s['length'] != length for s in scores),
      'longest_idle_s': round(float(np.diff(times).max()) / 1e9, 1)
      if len(times) > 1 else None}


def ordered_rows(logdir):
  """The stored train rows, ordered by env process and serial."""
  rows = stored_rows(Path(logdir) / 'replay')
  tag = rows['tag']
  order = np.lexsort((tag[:, 2], tag[:, 1], tag[:, 0]))
  return {k: v[order] for k, v in rows.items()}


def carry_pairs(rows):
  """Indices i where ordered rows i and i + 1 are consecutive steps of one
  env process within an episode: row i's carry is what row i + 1 used."""
  tag = rows['tag']
  return np.flatnonzero(
      (tag[1:, :2] == tag[:-1, :2]).all(1) & (tag[1:, 2] - tag[:-1, 2] == 1)
      & ~rows['is_first'][1:].astype(bool))


def stored_rows(directory):
  """Every row of the chunk files in `directory` (a kill mid-rewrite can
  leave two files of one chunk: the longer one holds all rows) with its
  row time under `time`."""
  from dreamer_ver.replay.chunk import Chunk
  chunks = {}
  for path in Path(directory).glob('*.npz'):
    chunk = Chunk.load(path)
    if chunk.uuid not in chunks or chunk.length > chunks[chunk.uuid].length:
      chunks[chunk.uuid] = chunk
  chunks = [c for c in chunks.values() if c.length]
  rows = {k: np.concatenate([c.data[k] for c in chunks])
          for k in chunks[0].data}
  rows['time'] = np.concatenate([c.times for c in chunks])
  return rows


def carries_mixed(logdir, rows, pairs, batch=1024):
  """How many of `pairs` (index i: rows i and i + 1 of one env) disagree
  with the policy: the state it computes from row i's latent and action and
  row i + 1's observation must be the stored latent of row i + 1."""
  import elements
  import jax
  from dreamer_ver.agent import checkpoint
  from dreamer_ver.agent.agent import policy_params
  from dreamer_ver.runtime.agent_process import build_agent
  config = elements.Config.load(Path(logdir) / 'config.yaml')
  agent = build_agent(config)
  _, state, _ = checkpoint.restore(agent, config.logdir, config.seed)
  params = policy_params(state['params'])
  step = jax.jit(lambda carry, obs: agent.policy_step(
      params, carry, obs, jax.random.PRNGKey(0))[2]['dyn/deter'])
  mixed = 0
  for begin in range(0, len(pairs), batch):
    i = pairs[begin:begin + batch]
    carry = {'deter': rows['dyn/deter'][i], 'stoch': rows['dyn/stoch'][i],
             'action': {k: rows[k][i] for k in agent.act_space}}
    obs = {k: rows[k][i + 1] for k in agent.obs_space
           if not k.startswith('log/')}
    deter = np.asarray(step(carry, obs))
    mixed += int((~np.isclose(deter, rows['dyn/deter'][i + 1],
                              rtol=1e-3, atol=1e-4).all(1)).sum())
  return mixed


def pick(logdir, kind, rng):
  """A running process of `kind`: (name, pid), pid None if none runs now
  (it is restarting)."""
  names = sorted(n for n in watch.pids(logdir) if kind_of(n) == kind)
  name = rng.choice(names) if names else None
  pid = watch.pids(logdir).get(name)
  return name, pid if pid is not None and watch.alive(pid) else None


def kill(logdir, kind, rng, at, **_):
  """SIGKILLs one process of `kind`; returns what was done."""
  name, pid = pick(logdir, kind, rng)
  if pid is not None:
    os.kill(pid, signal.SIGKILL)
  return {'t': round(at, 1), 'kind': kind, 'fault': 'kill', 'name': name,
          'pid': pid}


def stop(logdir, kind, rng, at, stop_for, **_):
  """SIGSTOPs one process of `kind` and SIGCONTs it after a while (on a
  thread: the soak goes on meanwhile), unless it was killed by then."""
  name, pid = pick(logdir, kind, rng)
  seconds = round(rng.uniform(*stop_for), 1)
  resume = None
  if pid is not None:
    os.kill(pid, signal.SIGSTOP)

    def cont():
      time.sleep(seconds)
      try:
        os.kill(pid, signal.SIGCONT)
      except ProcessLookupError:
        pass  # Its supervisor killed the hung process.
    resume = threading.Thread(target=cont, daemon=True)
    resume.start()
  return {'t': round(at, 1), 'kind': kind, 'fault': 'stop', 'name': name,
          'pid': pid, 'seconds': seconds, 'resume': resume}
