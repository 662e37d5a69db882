"""bench/gpu/gpu.py, the command a GPU window runs, end to end on the CPU
(`--smoke`): every stage runs its real benchmark, tiny, so the command
keeps working as the code changes."""

import json
import subprocess
import sys
import zipfile

import pytest

from bench.gpu import gpu_wheels
from helpers import ROOT


def test_every_stage_of_the_gpu_command_runs_and_reports(tmp_path):
  out = tmp_path / 'out'
  proc = subprocess.run(
      [sys.executable, '-m', 'bench.gpu.gpu', '--smoke', '--out',
       str(out), '--logdir', str(tmp_path / 'logdir')],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert sorted(p.name for p in out.iterdir()) == [
      'gpu.json', 'gpu.log', 'gpu.md', 'scores.jsonl']
  records = {r['stage']: r for r in json.loads((out / 'gpu.json').read_text())}
  assert list(records) == ['stack', 'learner', 'e2e', 'overhead', 'actor',
                           'shared', 'tests', 'learning']
  assert all(r['ok'] for r in records.values())
  assert records['stack']['results']['backend'] == 'cpu'
  learner = records['learner']['results']
  assert sorted(learner) == ['cmdbuf_while', 'small', 'upstream']
  for name in learner:
    rows = {r['variant']: r for r in learner[name]['rows']}
    assert sorted(rows) == ['base', 'unroll2']
    assert all(r['size'] == 'debug' and r['updates_per_s'] > 0
               and r['gflop_per_update'] > 0 for r in rows.values())
    assert rows['base']['x_base'] == 1.0
  assert learner['upstream']['rows'][0]['profile']['ops']
  # bench/system/e2e.py's smoke, our half: CI has no upstream source, and the
  # results say so.
  e2e = records['e2e']['results']
  assert e2e['upstream_skipped'] == 'no upstream source given (--upstream SRC)'
  entry = e2e['tasks']['dummy_disc']
  assert 'upstream' not in entry and 'ratios' not in entry
  (run,) = entry['ours']['rounds']
  # Stopped at its budget by the bench, not ended by itself or killed.
  assert run['exit'] is None and 89 <= run['seconds'] <= 92
  assert run['env_steps'] > 0 and run['updates'] > 0
  assert 0 < run['first_action_s'] <= run['first_update_s'] <= 90
  assert run['cpu_s'] > 0 and run['peak_rss_gb'] > 0
  assert entry['ours']['env_steps_per_s'] == run['env_steps_per_s']
  assert run['env_steps_per_s'] == pytest.approx(
      run['env_steps'] / run['seconds'], rel=1e-2)
  overhead = records['overhead']['results']
  assert [r['bucket'] for r in overhead['host']] == [1, 2, 4]
  stages = {(r['policy'], r['bucket']): r for r in overhead['stages']}
  assert sorted(stages) == [(p, b) for p in ('null', 'policy')
                            for b in (1, 2, 4)]
  assert all(r['handle_us'] > r['admit_us'] > 0 for r in stages.values())
  actor = records['actor']['results']
  assert {(r['transport'], r['mode']) for r in actor} == {
      ('tcp', 'baseline'), ('tcp', 'ver'), ('tcp', 'preempt'),
      ('shm', 'ver'), ('shm', 'preempt')}
  assert all(r['sps'] > 0 for r in actor)
  (shared,) = records['shared']['results']  # a learner beside the actor
  assert (shared['mode'], shared['transport']) == ('ver', 'tcp')
  assert shared['sps'] > 0
  assert shared['learner_ups'] > 0 and shared['learner_alone_ups'] > 0
  tests = records['tests']['results']
  assert tests['tests'] == 1 and tests['failures'] == tests['errors'] == 0
  (gaps,) = tests['properties'].values()  # bf16 against f32, recorded
  assert int(gaps['updates']) == 8 and 0 < float(gaps['update_gap']) < 0.3
  learning = records['learning']['results']
  assert learning['episodes'] > 0 and learning['last_step'] > 0
  assert '| dmc_walker_walk |' in learning['table']
  report = (out / 'gpu.md').read_text()
  for stage in records:
    assert f'### {stage} (ok' in report


def test_slimming_a_wheel_drops_the_files_and_their_record_lines(tmp_path):
  wheel = tmp_path / 'pkg-1.0-py3-none-any.whl'
  with zipfile.ZipFile(wheel, 'w') as z:
    z.writestr('pkg/__init__.py', 'x = 1\n')
    z.writestr('pkg/assets/big.bin', b'\0' * 1000)
    z.writestr('pkg-1.0.dist-info/RECORD', 'stale\n')
  gpu_wheels.slim(wheel, ('pkg/assets/',))
  with zipfile.ZipFile(wheel) as z:
    assert sorted(z.namelist()) == ['pkg-1.0.dist-info/RECORD',
                                    'pkg/__init__.py']
    record = z.read('pkg-1.0.dist-info/RECORD').decode().splitlines()
  assert record == [
      f"pkg/__init__.py,{gpu_wheels.digest(b'x = 1' + bytes([10]))},6",
      'pkg-1.0.dist-info/RECORD,,']
