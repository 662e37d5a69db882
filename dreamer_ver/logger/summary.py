"""The lines a finished run ends with: how far it got, its last scores,
where its outputs are, and how to look at them or go on."""

import json
from pathlib import Path


def summary(logdir, seconds, code=0, reached=None):
  """The summary of the run in `logdir` that took `seconds` this time and
  ends with exit code `code`: one line after a stop whose own line said
  what to do (2: a mistake at start, a full disk), naming the env step
  `reached` where it is past the last save's (the logger could not save
  it)."""
  logdir = Path(logdir)
  step = _read_json(logdir / 'ckpt' / 'logger.json').get('step', 0)
  if code == 2 and not (step or reached):
    return ('Run stopped before it started (exit code 2): fix what the '
            'error above names, then run the same command again.')
  if code == 2:  # e.g. a full disk
    at = f' at env step {reached:_}' if reached and reached > step else ''
    return (f'Run stopped{at} (exit code 2); its last save was at env step '
            f'{step:_}: fix what the error above names, then run the same '
            'command again to resume.')
  train, evals = _last_scores(logdir / 'scores.jsonl')
  scores = ', '.join(
      f'{label} {score:.2f}' for label, score in (
          ('last train score', train), ('last eval score', evals))
      if score is not None) or 'no episode finished yet'
  hours, rest = divmod(int(seconds), 3600)
  lines = [
      f'Run ended at env step {step:_} after {hours}:{rest // 60:02d}:'
      f'{rest % 60:02d}; {scores}.',
      f'  outputs:  {logdir}/metrics.jsonl, scores.jsonl, ckpt/',
      f'  plot:     python -m dreamer_ver.logger.plot {logdir}',
      f'  curves:   tensorboard --logdir {logdir}  (with logger.outputs '
      'tensorboard)',
      '  resume:   run the same command again']
  return '\n'.join(lines)


def _last_scores(path):
  """The newest train and eval episode scores in scores.jsonl (None if
  there is none)."""
  train = evals = None
  try:
    lines = path.read_text(errors='replace').splitlines()[-1000:]
  except OSError:
    return None, None
  for line in lines:
    try:
      record = json.loads(line)
    except ValueError:
      continue  # A line cut by a kill.
    if record.get('eval'):
      evals = record['score']
    else:
      train = record['score']
  return train, evals


def _read_json(path):
  try:
    return json.loads(Path(path).read_text())
  except (OSError, ValueError):
    return {}
