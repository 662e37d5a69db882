"""Storage faults for the chaos soak (bench/chaos.py `--faults fill
corrupt`): a logdir on a file system of its own, filled to the last byte
and freed again, and an agent checkpoint damaged between two lives of the
run. Each ends a life of the run (`Run`); the same command starts the next.

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

import contextlib
import errno
import json
import os
import re
import signal
import struct
import subprocess
import time
import zipfile
from pathlib import Path

import watch

ROOT = Path(__file__).resolve().parent.parent
BALLAST = 'ballast'  # the filler's file name, in the filled folder


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
