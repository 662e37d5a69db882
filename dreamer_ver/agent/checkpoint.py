"""Save and load agent state as a flat name -> array `.npz`, without pickle.

Loading needs a template of the expected structure (a freshly initialised
state of the same config); names, shapes and dtypes must all match, and any
mismatch is reported by name instead of as a pytree traceback.

A run's checkpoint folder (`logdir/ckpt/`, `Checkpoint`) holds `agent.npz`
(params, optimizer, slow critic, normaliser, step and RNG, and the counters:
env steps served, params version) and `counters.json` (a readable copy of
the counters: the file's own are read, so that a save killed between the
two writes cannot pair one save's arrays with another's counters), the
latest; with
`keep` > 1 also the `keep - 1` saves before it, each a folder of the same
two files, `ckpt/saved/<env step>/`, which `run.from_checkpoint` can name.
The newest of them shares its file with `agent.npz` (a hard link).
orbax-checkpoint is not used: the state is a few arrays written atomically
with `os.replace`, loaded without pickle against a template, which is all
the runtime needs.
"""

import json
import os
import pathlib
import shutil
import zipfile

import jax
import numpy as np

from dreamer_ver.core.atomic import write_atomically, write_json
from dreamer_ver.core.keys import key_problems
from dreamer_ver.config.validation import ConfigError


class CheckpointMismatch(ValueError):
  pass


class CheckpointUnreadable(ConfigError):
  """No save of a logdir's checkpoint folder can be read. Like a config
  error, the user must act before the run can start: its message is the
  one line that names the files and what to do (and exit code 2)."""


# The entry of `agent.npz` that holds the counters, as UTF-8 JSON bytes.
COUNTERS = '__counters__'
# What reading a damaged save raises (a cut or flipped zip member fails
# its CRC-32 check: zipfile.BadZipFile; a cut counters.json: ValueError).
DAMAGED = (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile)


def flatten(tree):
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(path): np.asarray(x) for path, x in leaves}


def save(tree, path, counters=None):
  """Writes atomically: a reader never sees a half-written file. The
  `counters` (a JSON-able dict) go into the same file."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  arrays = flatten(tree)
  if counters is not None:
    arrays[COUNTERS] = np.frombuffer(json.dumps(counters).encode(), np.uint8)
  write_atomically(path, lambda file: np.savez(file, **arrays))


def load(path, template):
  """Returns a tree shaped like `template` with the values stored at `path`."""
  return _load(path, template)[0]


def _load(path, template):
  """(tree shaped like `template`, the counters stored with it or None)."""
  with np.load(path, allow_pickle=False) as data:
    stored = {k: data[k] for k in data.files}
  counters = stored.pop(COUNTERS, None)
  if counters is not None:
    counters = json.loads(counters.tobytes())
  leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
  expected = {jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves}
  problems = key_problems(expected, stored, limit=3)
  for name in sorted(set(expected) & set(stored)):
    want, got = expected[name], stored[name]
    if want.shape != got.shape or want.dtype != got.dtype:
      problems.append(
          f'{name}: expected {want.dtype}{list(want.shape)}, '
          f'checkpoint has {got.dtype}{list(got.shape)}')
  if problems:
    raise CheckpointMismatch(
        f'checkpoint {path} does not fit this config: ' + '; '.join(
            problems[:5]) + (f' (+{len(problems) - 5} more)' if len(
                problems) > 5 else ''))
  values = [stored[jax.tree_util.keystr(p)] for p, _ in leaves]
  return jax.tree_util.tree_unflatten(treedef, values), counters


def checkpoint_dir(path):
  """The folder holding `agent.npz` for a logdir or a checkpoint folder."""
  path = pathlib.Path(path).expanduser()
  if (path / 'agent.npz').is_file():
    return path
  return path / 'ckpt'


class Checkpoint:
  """The agent's checkpoint folder of a logdir (or the folder itself);
  `keep`: how many saves are kept (the latest and `keep - 1` before it)."""

  def __init__(self, path, keep=1):
    if keep < 1:
      raise ValueError(f'keep must be >= 1, got {keep}')
    self.directory = checkpoint_dir(path)
    self.keep = int(keep)

  @property
  def exists(self):
    return (self.directory / 'agent.npz').exists()

  def load(self, template):
    """(state shaped like `template`, counters); CheckpointMismatch names
    what does not fit. The counters are the file's own; counters.json
    only where a save has none (written before they went into it)."""
    state, counters = _load(self.directory / 'agent.npz', template)
    if counters is None:
      counters = json.loads((self.directory / 'counters.json').read_text())
    return state, counters

  def save(self, state, counters):
    save(state, self.directory / 'agent.npz', counters)
    write_json(self.directory / 'counters.json', counters)
    if self.keep > 1:
      self._snapshot(counters)

  def saved(self):
    """The kept earlier saves, oldest first (folders `run.from_checkpoint`
    can name)."""
    folder = self.directory / 'saved'
    return sorted(p for p in folder.glob('*') if p.name.isdigit() and (
        p / 'agent.npz').is_file()) if folder.is_dir() else []

  def _snapshot(self, counters):
    """Keeps this save as `saved/<env step>/` and drops the oldest beyond
    `keep - 1`, and whatever a save or removal killed midway left there."""
    folder = self.directory / 'saved' / f"{int(counters.get('steps', 0)):012d}"
    tmp = folder.with_name(folder.name + '.tmp')
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    os.link(self.directory / 'agent.npz', tmp / 'agent.npz')
    write_json(tmp / 'counters.json', counters)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)  # A reader never sees a half-kept save.
    kept = self.saved()[-(self.keep - 1):]
    for old in folder.parent.iterdir():
      if old not in kept:
        shutil.rmtree(old, ignore_errors=True)


def newest_intact(ckpt, template):
  """(state, counters) of the newest save of `ckpt` that reads: the latest,
  else the kept ones newest first, saying in one line which were skipped
  and why. CheckpointUnreadable if none reads; CheckpointMismatch (a
  config that does not fit) is raised as it is, not skipped."""
  skipped = []
  for folder in [ckpt.directory, *reversed(ckpt.saved())]:
    try:
      state, counters = Checkpoint(folder).load(template)
    except CheckpointMismatch:
      raise
    except DAMAGED as error:
      skipped.append(f'{folder / "agent.npz"} ({type(error).__name__}: '
                     f'{error})')
      continue
    if skipped:
      print(f'Skipped the unreadable checkpoint {"; ".join(skipped)}.',
            flush=True)
    print(f'Agent resumed at step {counters["steps"]} (params version '
          f'{counters["version"]}) from {folder}.', flush=True)
    return state, counters
  raise CheckpointUnreadable(
      f'no checkpoint in {ckpt.directory} can be read: '
      f'{"; ".join(skipped)}. Put back an intact copy, or move '
      f'{ckpt.directory / "agent.npz"} and {ckpt.directory / "saved"} away '
      'to start the agent afresh (replay and logs stay).')


def restore(agent, logdir, seed, from_checkpoint='', keep=1):
  """(Checkpoint of `logdir` keeping `keep` saves, state, counters) to
  start a run from: the logdir's checkpoint when it has one (resume), else
  the state saved at `from_checkpoint` (a logdir, a checkpoint folder or a
  kept save) with fresh counters (warm start), else a fresh state from
  `seed`."""
  ckpt = Checkpoint(logdir, keep)
  state = agent.init_state(agent.init_params(seed), seed)
  counters = {'steps': 0, 'version': 0}
  if ckpt.exists:
    state, counters = newest_intact(ckpt, state)
  elif from_checkpoint:
    source = Checkpoint(from_checkpoint)
    if not source.exists:
      raise FileNotFoundError(
          f'run.from_checkpoint: no checkpoint at '
          f'{source.directory / "agent.npz"}')
    state, _ = source.load(state)
    print(f'Warm start from {source.directory}.', flush=True)
  return ckpt, state, counters
