"""A short chaos soak (bench/soaks/chaos.py): the parallel runtime while its env,
replay, logger and agent processes keep getting SIGKILLed and, where the
test may mount a tmpfs (root), its logdir's disk is filled once, checked by
the rows and episodes it leaves on disk across the run's lives."""

import contextlib

import numpy as np

from bench.soaks import chaos, faults
from helpers.storage import can_mount

FILL = can_mount()  # a tmpfs to fill (root: CI)


def test_a_short_chaos_soak_loses_mixes_and_duplicates_nothing(tmp_path):
  logdir = tmp_path / 'run'
  with (faults.mounted(logdir, 256) if FILL
        else contextlib.nullcontext()):
    _soak_and_check(logdir)


def _soak_and_check(logdir):
  # The fill's stop and restart take about 30 s of the soak's time.
  report = chaos.chaos(logdir, minutes=2 if FILL else 1.5,
                       kill_every=(8, 12), envs=3, length=20,
                       step_time=0.01,
                       faults=('kill', 'fill') if FILL else ('kill',))
  summary = chaos.format_report(report)
  fills = report['faults_done'].get('disk fill', 0)
  if FILL:  # Each a stop in one line, exit code 2; the next life resumed.
    assert fills >= 1 and report['storage_faults_handled'] == fills, summary
    assert report['lives'] == fills + 1, summary
  # Every kind of component was killed (shuffled rounds of four) and came
  # back, and the run still ended cleanly.
  assert set(report['killed']) == set(faults.KINDS), summary
  assert all(report['restarts'][kind] >= report['killed'][kind]
             for kind in faults.KINDS), summary
  assert report['exit_code'] == 0 and not report['left_running'], summary
  assert report['lost_rows'] == 0 and report['duplicated_rows'] == 0, summary
  assert report['checked_carries'] > 500, summary
  assert report['carries_mixed'] == 0, summary
  assert report['episodes_logged'] > 10, summary
  # Only a full disk cuts a line of scores.jsonl: at most one per fill.
  assert report['score_lines_cut'] <= (fills if FILL else 0), summary
  assert report['episodes_twice'] == 0, summary
  assert report['episodes_with_holes'] == 0, summary
  assert report['ok'], summary
  # The carry check can fail: give each checked step the latent of another
  # env's row, and (nearly) every pair is caught; the tiny debug model maps
  # a rare pair of different carries to nearly the same state.
  rows = faults.ordered_rows(logdir)
  pairs = faults.carry_pairs(rows)[::2][:200]
  pairs = pairs[~np.isin(pairs + 1, pairs)]  # Targets stay unswapped.
  envs = rows['tag'][:, 0]
  rng = np.random.default_rng(0)
  other = np.array([rng.choice(np.flatnonzero(envs != envs[i]))
                    for i in pairs])
  swapped = {**rows, 'dyn/deter': rows['dyn/deter'].copy(),
             'dyn/stoch': rows['dyn/stoch'].copy()}
  swapped['dyn/deter'][pairs] = rows['dyn/deter'][other]
  swapped['dyn/stoch'][pairs] = rows['dyn/stoch'][other]
  assert faults.carries_mixed(logdir, rows, pairs) == 0
  assert faults.carries_mixed(logdir, swapped, pairs) >= 0.9 * len(pairs)
