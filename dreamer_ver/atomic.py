"""Atomic file writes every layer may use (plain Python, no JAX)."""

import json
import os
from pathlib import Path


def write_json(path, data):
  """Writes `data` as JSON atomically: a reader never sees a half file."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(path.name + '.tmp')
  tmp.write_text(json.dumps(data))
  os.replace(tmp, path)
