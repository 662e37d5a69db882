"""The logger's outputs: where each metrics write and each video goes.

``make_outputs(config, logdir)`` builds the list the logger writes to, from
``logger.outputs``. Every output has the same three methods:

  output.write(step, scalars)            # {name: float}, one metrics write
  output.video(step, name, frames, gif)  # uint8 [T, H, W, C] and its GIF file
  output.close()

* ``Jsonl`` is always first: one line per write in ``metrics.jsonl``. Its
  video record is the GIF file itself (``<logdir>/videos/``, written by the
  logger with ``write_gif`` before any output sees it), so naming ``jsonl``
  in ``logger.outputs`` adds nothing.
* ``TensorBoard`` writes an event file in the logdir with the
  ``tensorboard`` package's own writer (no TensorFlow): scalars as simple
  values, a video as its animated GIF in an image summary, as DreamerV3
  shows videos.
* ``WandB`` logs to a Weights & Biases run named after the logdir, in
  ``logger.wandb_project``, mode ``logger.wandb_mode``, with the run's config.
  The run id is kept in ``<logdir>/wandb/run.json``, so a restarted logger
  resumes the same run. W&B drops a write whose step is below the newest it
  has, so after a restart the writes are dropped until the step passes the
  newest written before it (the logger's step resumes from its last save).

An output whose package is missing fails to build with an ImportError that
names the pip extra to install, rather than silently writing nothing.

Why not ``elements.logger``'s outputs: its ``JSONLOutput`` prints a line at
every write and drops Python floats, its ``TensorBoardOutput`` needs
TensorFlow, its ``WandBOutput`` encodes videos as mp4 (moviepy) and its GIF
encoder runs ffmpeg; these write the same files with the packages already
installed and a quiet terminal.

Nothing here is thread-safe: the logger calls its outputs from one thread.
"""

import importlib.util
import json
import secrets
import time

import numpy as np

from dreamer_ver.config.loading import redacted
from dreamer_ver.core.atomic import append_line, write_atomically, write_json

# The package each optional output imports (the pip extra has its name).
PACKAGES = {'tensorboard': 'tensorboard', 'wandb': 'wandb'}


def make_outputs(config, logdir):
  """``Jsonl`` and the outputs ``logger.outputs`` names (validated)."""
  names = config.logger.outputs
  outputs = [Jsonl(logdir)]
  if 'tensorboard' in names:
    outputs.append(TensorBoard(logdir))
  if 'wandb' in names:
    outputs.append(WandB(config, logdir))
  return outputs


def missing(config):
  """The install hint for the first output of ``logger.outputs`` whose
  package is not installed, else ''. The scripts that start a logger check
  this first: the logger itself would fail in a restart loop."""
  for name in config.logger.outputs:
    if name in PACKAGES and importlib.util.find_spec(PACKAGES[name]) is None:
      return (f"logger.outputs has '{name}', but {PACKAGES[name]} is not "
              f"installed: pip install 'dreamer_ver[{name}]'")
  return ''


def write_gif(path, frames, fps):
  """Writes uint8 frames [T, H, W, C] (C 1 or 3) as a looping GIF, whole
  or not at all (`atomic.write_atomically`)."""
  from PIL import Image
  frames = np.asarray(frames)
  if frames.shape[-1] == 1:
    images = [Image.fromarray(frame[..., 0], 'L') for frame in frames]
  else:
    images = [Image.fromarray(frame, 'RGB') for frame in frames]
  path.parent.mkdir(parents=True, exist_ok=True)
  write_atomically(path, lambda file: images[0].save(
      file, format='GIF', save_all=True, append_images=images[1:],
      duration=round(1000 / fps), loop=0))


def _missing(output, error):
  """The one-line error of an output whose package (the pip extra of the
  same name) cannot be imported."""
  return ImportError(
      f"logger.outputs has '{output}', but it cannot be imported ({error}): "
      f"pip install 'dreamer_ver[{output}]'")


class Jsonl:
  """``metrics.jsonl``: one JSON line per write, its step first."""

  def __init__(self, logdir):
    self.path = logdir / 'metrics.jsonl'

  def write(self, step, scalars):
    append_line(self.path, json.dumps({'step': step, **scalars}))

  def video(self, step, name, frames, gif):
    pass  # The GIF file is the record.

  def close(self):
    pass


class TensorBoard:
  """An event file in the logdir, flushed after every write."""

  def __init__(self, logdir):
    try:
      from tensorboard.compat.proto import event_pb2, summary_pb2
      from tensorboard.summary.writer import event_file_writer
    except ImportError as error:
      raise _missing('tensorboard', error) from error
    self.Event = event_pb2.Event
    self.Summary = summary_pb2.Summary
    self.writer = event_file_writer.EventFileWriter(str(logdir))

  def write(self, step, scalars):
    self._add(step, [self.Summary.Value(tag=name, simple_value=value)
                     for name, value in scalars.items()])

  def video(self, step, name, frames, gif):
    _, height, width, channels = frames.shape
    image = self.Summary.Image(
        height=height, width=width, colorspace=channels,
        encoded_image_string=gif.read_bytes())
    self._add(step, [self.Summary.Value(tag=name, image=image)])

  def _add(self, step, values):
    self.writer.add_event(self.Event(
        wall_time=time.time(), step=step, summary=self.Summary(value=values)))
    self.writer.flush()

  def close(self):
    self.writer.close()


class WandB:
  """A W&B run that a restarted logger resumes (its id is in the logdir)."""

  def __init__(self, config, logdir):
    try:
      import wandb
    except ImportError as error:
      raise _missing('wandb', error) from error
    self.wandb = wandb
    saved = logdir / 'wandb' / 'run.json'
    if saved.exists():
      run_id = json.loads(saved.read_text())['id']
    else:
      run_id = secrets.token_hex(8)
      write_json(saved, {'id': run_id})
    self.run = wandb.init(
        project=config.logger.wandb_project, dir=str(logdir),
        mode=config.logger.wandb_mode, name=logdir.name, id=run_id,
        resume='allow', config=dict(redacted(config).flat))

  def write(self, step, scalars):
    self.run.log(scalars, step=step)

  def video(self, step, name, frames, gif):
    self.run.log({name: self.wandb.Video(str(gif))}, step=step)

  def close(self):
    self.run.finish()
    # finish() may return before W&B's service process has written the
    # run's last records (seen in offline mode); its teardown waits.
    self.wandb.teardown()
