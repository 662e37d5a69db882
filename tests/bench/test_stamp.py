"""bench/stamp.py: every result file names its commit and machine."""

import json
import os
import subprocess
import sys

from bench import stamp
from helpers import ROOT


def test_the_stamp_names_this_commit_and_this_machine():
  head = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=ROOT,
                        capture_output=True, text=True).stdout.strip()
  given = stamp.stamp()
  assert given['commit'] in (head, head + '+changes'), given
  assert given['machine']['cores'] == os.cpu_count()
  assert given['machine']['python'] == '.'.join(map(str, sys.version_info[:3]))
  assert given['machine']['cpu']


def test_a_written_result_keeps_its_keys_and_wraps_its_records(tmp_path):
  stamp.write(tmp_path / 'a.json', {'sps': 3.5, 'commit': 'mine'})
  stamp.write(tmp_path / 'b.json', [{'mode': 'ver'}, {'mode': 'preempt'}])
  a = json.loads((tmp_path / 'a.json').read_text())
  b = json.loads((tmp_path / 'b.json').read_text())
  assert a['sps'] == 3.5 and a['commit'] == 'mine'  # a bench's own wins
  assert b['records'] == [{'mode': 'ver'}, {'mode': 'preempt'}]
  assert b['commit'] == stamp.stamp()['commit'] and 'cpu' in b['machine']
