"""The logger service: counts env steps, turns transitions into episodes,
writes metrics. ``LoggerService`` holds the logic and is usable without
sockets (``runtime/logger_process.py`` serves it; the design of episodes,
resends and videos: docs/architecture.md, "The logger").

* ``transitions(trans)`` gets every transition batch the actor serves: rows
  of train envs advance the env step counter (every curve's x-axis); each
  finished episode, complete and without a hole, becomes
  ``episode/score`` and ``episode/length`` (``eval_episode/*`` for an eval
  env) and a line of ``scores.jsonl``; a batch whose shipment seq was
  counted already (a resend) is ignored; uint8 columns [N, H, W, C] are
  recorded as an episode's video now and then (``logger.video_every``).
* ``add(metrics)`` gets scalars from the other components, each averaged
  until the next ``write()``, and uint8 videos [T, H, W, C], the newest per
  key kept; other values are ignored.
* ``write()`` writes what was gathered to every output (``outputs.py``:
  ``metrics.jsonl`` always, TensorBoard and W&B as ``logger.outputs``
  asks), videos as ``videos/<name>_<step>.gif``, and prints a progress line.
* ``save()`` / ``load()`` keep the counters and the newest seq per sender;
  ``close()`` closes the outputs.

Metrics are aggregated with ``elements.Agg``; the progress line is ours
(``elements.logger.TerminalOutput`` prints a table of every metric).
Lengths exclude the reset step; scores include its reward (as upstream).
This module imports neither JAX nor the agent.
"""

import collections
import collections.abc
import dataclasses
import json
import math
import re
import threading
import time
from pathlib import Path

import elements
import numpy as np

from dreamer_ver.core.atomic import append_line, read_json, write_json
from dreamer_ver.logger.outputs import make_outputs, write_gif
from dreamer_ver.core.transitions import (
    LOGGER_KEYS, check_rows, is_log, shipment_of)


class _Episode:
  """The running totals of one env's open episode."""

  __slots__ = ('is_eval', 'score', 'length', 'logs', 'updated', 'frames')

  def __init__(self, is_eval, now):
    self.is_eval = is_eval
    self.score = 0.0
    self.length = 0
    self.logs = {}  # log key -> [sum, count]
    self.updated = now
    self.frames = None  # image key -> its frames, while recorded


@dataclasses.dataclass(frozen=True)
class Options:
  """What the logger service uses of a run config (`Options.of(config)`)."""

  filter: str  # logger.filter: the metric keys printed ('' = all)
  fps: int  # logger.fps: frames per second of the videos
  video_every: float  # logger.video_every: seconds between episode videos
  video_length: int  # logger.video_length: frames per video at most
  episode_timeout: float  # run.episode_timeout: an env silent this long
  steps: float  # run.steps: the run's target, for the progress line

  @classmethod
  def of(cls, config):
    logger = config.logger
    return cls(
        filter=str(logger.filter), fps=int(logger.fps),
        video_every=float(logger.video_every),
        video_length=int(logger.video_length),
        episode_timeout=float(config.run.episode_timeout),
        steps=float(config.run.steps))


class LoggerService:
  """Env step counter, episode aggregation and metric files of one run."""

  def __init__(self, options, logdir, outputs, clock=time.monotonic,
               out=print):
    """`outputs`: what metrics are written to (`outputs.make_outputs`)."""
    self.logdir = Path(logdir)
    self.logdir.mkdir(parents=True, exist_ok=True)
    self.ckpt = self.logdir / 'ckpt' / 'logger.json'
    self.scores_path = self.logdir / 'scores.jsonl'
    self.filter = re.compile(options.filter) if options.filter else None
    self.fps = options.fps
    self.video_every = options.video_every
    self.video_length = options.video_length
    self.timeout = options.episode_timeout
    self.target = options.steps
    self.clock = clock
    self.out = out

    self._lock = threading.RLock()
    self._step = 0
    self._episodes_done = {'train': 0, 'eval': 0}
    self._open = {}  # envid -> _Episode
    self._arrived = clock()  # when the last batch came
    self._shipments = {}  # sender -> seq of its newest shipment counted
    self._agg = elements.Agg()  # metrics (means) and parallel/* (sums)
    self._latest = {}  # 'score', 'eval_score', 'fps/train' -> last value
    self._videos = {}  # name -> uint8 [T, H, W, C], the newest until a write
    self._recording = None  # (envid, _Episode) whose frames are kept
    self._last_video = -math.inf  # clock() when the newest episode video ended
    self._seen_eval = False  # an eval row arrived: record eval episodes only
    self.activity = 0
    self._last_write = (self._step, clock())
    self.outputs = outputs

  @classmethod
  def of(cls, config, **kwargs):
    """The service of a run config: its options and outputs, in its
    logdir (made first: the outputs write there)."""
    Path(config.logdir).mkdir(parents=True, exist_ok=True)
    return cls(Options.of(config), config.logdir,
               make_outputs(config, Path(config.logdir)), **kwargs)

  @property
  def step(self):
    """Env steps of train envs so far (restored by ``load``)."""
    return self._step

  @property
  def episodes(self):
    """Finished train episodes so far (restored by ``load``)."""
    return self._episodes_done['train']

  # --------------------------------------------------------- transitions

  def transitions(self, trans):
    """Counts env steps and aggregates episodes from a transition batch
    (unless it is a resend of one already counted)."""
    columns, logs, images = self._check(trans)
    shipment = shipment_of(trans, 'transitions')
    envids, is_eval = columns['envid'], columns['is_eval']
    is_first, is_last = columns['is_first'], columns['is_last']
    rewards = columns['reward']
    missed = columns.get('missed')
    with self._lock:
      self.activity += 1
      if shipment is not None:
        sender, seq = shipment
        if seq <= self._shipments.get(sender, -1):
          return {}
        self._shipments[sender] = seq
      now = self.clock()
      self._resume(now)
      self._seen_eval = self._seen_eval or bool(is_eval.any())
      for i in range(len(envids)):
        envid, evaluating = int(envids[i]), bool(is_eval[i])
        if not evaluating:
          self._step += 1
        if missed is not None and missed[i] > 0:
          if not evaluating:
            self._step += int(missed[i])
          if self._open.pop(envid, None) is not None:
            self._count('parallel/ep_gap')
        episode = self._open.get(envid)
        if is_first[i]:
          self._count('parallel/ep_starts')
          if episode is not None:  # It never saw is_last: a half episode.
            self._count('parallel/ep_abandoned')
          episode = self._open[envid] = _Episode(evaluating, now)
          if images and self._should_record(evaluating, now):
            episode.frames = {key: [] for key in images}
            self._recording = (envid, episode)
        elif episode is None:
          continue  # Its start came before this logger (re)started.
        episode.updated = now
        episode.score += float(rewards[i])
        episode.length += 1
        for key, values in logs.items():
          entry = episode.logs.setdefault(key, [0.0, 0])
          entry[0] += float(values[i])
          entry[1] += 1
        if episode.frames is not None:
          for key, values in images.items():
            frames = episode.frames.setdefault(key, [])
            if len(frames) < self.video_length:
              frames.append(values[i].copy())  # Not a view: frees the batch.
        if is_last[i]:
          self._count('parallel/ep_ends')
          del self._open[envid]
          self._finish(envid, episode, now)
      self._expire()
    return {}

  def _should_record(self, evaluating, now):
    """Whether the episode starting now is the next one recorded."""
    if self.video_every <= 0 or now - self._last_video < self.video_every:
      return False
    if self._recording is not None:
      envid, episode = self._recording
      if self._open.get(envid) is episode:
        return False  # One at a time; a dropped one is no longer open.
    return evaluating or not self._seen_eval

  def _finish(self, envid, episode, now):
    kind = 'eval' if episode.is_eval else 'train'
    name = 'eval_episode' if episode.is_eval else 'episode'
    stats = 'eval_epstats' if episode.is_eval else 'epstats'
    score, length = episode.score, episode.length - 1
    self._episodes_done[kind] += 1
    self._mean(f'{name}/score', score)
    self._mean(f'{name}/length', length)
    for key, (total, count) in episode.logs.items():
      self._mean(f'{stats}/{key}', total / count)
    self._latest['eval_score' if episode.is_eval else 'score'] = score
    if episode.frames:
      for key, frames in episode.frames.items():
        self._videos[f'{name}/{key}'] = np.stack(frames)
      self._last_video = now
    record = {
        'step': self._step, 'env': envid, 'score': score, 'length': length,
        'eval': episode.is_eval, 'time': time.time(),
        # The episode's mean of each scalar log/ key (e.g. log/episode).
        **{key: total / count for key, (total, count) in episode.logs.items()}}
    append_line(self.scores_path, json.dumps(record))

  def _resume(self, now):
    """After no batch for the timeout (the run stopped and continued, its
    machine suspended, its actor restarting), no env was silent while
    others stepped: the open episodes' clocks skip the pause."""
    pause, self._arrived = now - self._arrived, now
    if self.timeout > 0 and pause >= self.timeout:
      for episode in self._open.values():
        episode.updated += pause

  def _expire(self):
    """Drops the open episodes of envs silent for the timeout while batches
    kept coming: measured to the last batch, not to the clock, as a pause
    of the whole run is no env's silence (`_resume`)."""
    if self.timeout <= 0:
      return
    for envid in [
        envid for envid, episode in self._open.items()
        if self._arrived - episode.updated >= self.timeout]:
      del self._open[envid]
      self._count('parallel/ep_timeout')

  def _check(self, trans):
    """(required columns, scalar log/ columns, image columns), or
    ValueError; no side effects."""
    trans = check_rows(trans, 'transitions', required=LOGGER_KEYS)
    columns = {key: trans[key] for key in LOGGER_KEYS}
    if 'missed' in trans:
      missed = trans['missed']
      if missed.ndim != 1 or not np.issubdtype(missed.dtype, np.integer) or (
          missed < 0).any():
        raise ValueError(
            "transitions: 'missed' must be non-negative integers [N].")
      columns['missed'] = missed
    # Numeric scalars per row of log/ keys are aggregated, and frames of any
    # key can be recorded; other values are ignored.
    logs, images = {}, {}
    for key, value in trans.items():
      if is_log(key) and value.ndim == 1 and (
          np.issubdtype(value.dtype, np.number) or value.dtype == bool):
        logs[key] = value
      elif _is_video(value):
        images[key] = value
    return columns, logs, images

  # ------------------------------------------------------------- metrics

  def add(self, metrics):
    """Averages scalar metrics and keeps the newest video per key until the
    next write; ignores other values."""
    if not isinstance(metrics, collections.abc.Mapping):
      raise TypeError(
          f'add expects a dict of scalars, got {type(metrics).__name__}.')
    with self._lock:
      self.activity += 1
      for key, value in metrics.items():
        if _is_video(value):
          self._videos[str(key)] = value
          continue
        value = _scalar(value)
        if value is None:
          continue
        self._mean(str(key), value)
        if key == 'fps/train':
          self._latest['fps/train'] = value
    return {}

  def _mean(self, key, value):
    self._agg.add(key, value, agg='avg')

  def _count(self, key):
    self._agg.add(key, 1, agg='sum')

  def write(self):
    """Writes the metrics and videos gathered since the last write; returns
    the scalars' record (None when the step did not advance and nothing new
    arrived)."""
    with self._lock:
      now = self.clock()
      self._expire()
      scalars = {key: np.asarray(value).item()
                 for key, value in self._agg.result(reset=True).items()}
      videos, self._videos = self._videos, {}
      last_step, last_time = self._last_write
      if self._step == last_step and not scalars and not videos:
        return None
      fps = (self._step - last_step) / max(now - last_time, 1e-9)
      step = self._step
      self._last_write = (step, now)
      latest = dict(self._latest)
      episodes = self._episodes_done['train']
    # Outside the lock: encoding a GIF must not hold up transitions and add.
    for name, frames in videos.items():
      gif = self.logdir / 'videos' / f"{name.replace('/', '_')}_{step}.gif"
      write_gif(gif, frames, self.fps)
      for output in self.outputs:
        output.video(step, name, frames, gif)
    for output in self.outputs:
      output.write(step, scalars)
    record = {'step': step, **scalars}
    if step:  # Before the first env step (compiling) there is no progress.
      self.out(self._progress(record, fps, episodes, latest), flush=True)
    return record

  def close(self):
    """Closes the outputs (flushes TensorBoard, finishes the W&B run)."""
    for output in self.outputs:
      output.close()

  def _progress(self, record, fps, episodes, latest):
    step = record['step']
    parts = [f'step {step:_}', f'{fps:.1f} env steps/s', f'episodes {episodes}']
    if 'score' in latest:
      parts.append(f'score {record.get("episode/score", latest["score"]):.2f}')
    if 'eval_score' in latest:
      parts.append(f'eval score '
                   f'{record.get("eval_episode/score", latest["eval_score"]):.2f}')
    if 'fps/train' in latest:
      parts.append(f'{latest["fps/train"]:.1f} replayed steps/s')
    remaining = self.target - step
    if fps > 0 and remaining > 0:
      parts.append(f'ETA {_duration(remaining / fps)}')
    lines = ['[logger] ' + ' | '.join(parts)]
    if self.filter:
      shown = [
          f'{key} {_format(value)}' for key, value in record.items()
          if key != 'step' and self.filter.search(key)]
      if shown:
        lines.append('[logger] ' + ' / '.join(shown))
    return '\n'.join(lines)

  # --------------------------------------------------------- save / load

  def save(self):
    """Writes the step counter, episode counts and the newest shipment
    counted per sender atomically."""
    with self._lock:
      state = {'step': self._step, 'episodes': self._episodes_done['train'],
               'eval_episodes': self._episodes_done['eval'],
               'shipments': {str(sender): seq
                             for sender, seq in self._shipments.items()}}
    write_json(self.ckpt, state)

  def load(self):
    """Restores the counters; returns False when there is no checkpoint."""
    if not self.ckpt.exists():
      return False
    state = read_json(self.ckpt, "the logger's step and episode counts")
    with self._lock:
      self._step = int(state['step'])
      self._episodes_done['train'] = int(state.get('episodes', 0))
      self._episodes_done['eval'] = int(state.get('eval_episodes', 0))
      self._shipments = {int(sender): int(seq) for sender, seq
                         in state.get('shipments', {}).items()}
      self._last_write = (self._step, self.clock())
    return True


# ------------------------------------------------------------------ helpers

def _is_video(value):
  """Whether a value is uint8 frames [T, H, W, C] with C 1 or 3."""
  return isinstance(value, np.ndarray) and value.dtype == np.uint8 and (
      value.ndim == 4 and value.shape[-1] in (1, 3) and len(value) > 0)


def _scalar(value):
  """A float for numbers, bools and 0-d arrays; None for anything else."""
  if isinstance(value, (bool, int, float, np.number, np.bool_)):
    return float(value)
  if isinstance(value, np.ndarray) and value.ndim == 0 and (
      np.issubdtype(value.dtype, np.number) or value.dtype == bool):
    return float(value)
  return None


def _format(value):
  value = float(value)
  if value == 0 or not math.isfinite(value):
    return str(value if value else 0)
  if 0.01 <= abs(value) < 1e5:
    return f'{value:.4g}' if abs(value) < 100 else f'{value:.1f}'
  return f'{value:.2e}'


def _duration(seconds):
  seconds = int(seconds)
  hours, rest = divmod(seconds, 3600)
  return f'{hours}:{rest // 60:02d}:{rest % 60:02d}'
