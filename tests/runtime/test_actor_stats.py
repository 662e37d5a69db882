"""The actor's stats as the logger gets them (runtime/agent_process.py)."""

import elements

from dreamer_ver.runtime.agent_process import actor_stats


def test_the_histogram_sums_to_the_batches_when_the_logger_averages_two():
  """Two reports in one logger interval are averaged key by key; a bin
  that only one of them had would be averaged alone."""
  first = actor_stats({'batches': 3, 'batch_sizes': {5: 2, 1: 1}}, 5)
  second = actor_stats({'batches': 6, 'batch_sizes': {2: 1, 3: 4, 4: 1}}, 5)
  assert first == {'actor/batches': 3, 'actor/batch_size/001': 1,
                   'actor/batch_size/002': 0, 'actor/batch_size/004': 2}
  agg = elements.Agg()
  for report in (first, second):
    for key, value in report.items():
      agg.add(key, value, agg='avg')
  logged = agg.result()
  hist = {k: v for k, v in logged.items() if k.startswith('actor/batch_size/')}
  assert sum(hist.values()) == logged['actor/batches'] == 4.5
