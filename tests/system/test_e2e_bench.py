"""bench/e2e.py, the whole system beside upstream DreamerV3's, on its smoke
settings: our half runs for real (CI has no upstream source, so the
results say upstream's half was skipped and why)."""

import json
import subprocess
import sys

import pytest

from helpers import ROOT, runs


def test_our_half_of_the_smoke_serves_trains_and_reports(tmp_path):
  out = tmp_path / 'e2e.json'
  proc = subprocess.run(
      [sys.executable, str(ROOT / 'bench' / 'e2e.py'), '--smoke', '--logdir',
       str(tmp_path / 'runs'), '--out', str(out)],
      capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  result = json.loads(out.read_text())
  assert result['upstream_skipped'] == (
      'no upstream source given (--upstream SRC)')
  entry = result['tasks']['dummy_disc']
  assert 'upstream' not in entry and 'ratios' not in entry
  (run,) = entry['ours']['rounds']
  # Stopped at its budget by the bench, not ended by itself or killed.
  assert run['exit'] is None and 59 <= run['seconds'] <= 62
  assert run['env_steps'] > 0 and run['updates'] > 0
  assert 0 < run['first_action_s'] <= run['first_update_s'] <= 60
  assert run['cpu_s'] > 0 and run['peak_rss_gb'] > 0
  assert entry['ours']['env_steps_per_s'] == run['env_steps_per_s']
  assert run['env_steps_per_s'] == pytest.approx(
      run['env_steps'] / run['seconds'], rel=1e-2)
  assert not runs.children_alive(tmp_path / 'runs' / 'dummy_disc_ours_0')
