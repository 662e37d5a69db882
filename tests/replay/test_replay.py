"""Tests for dreamer_ver.replay: checked by value, not just by shape.

Most tests store a per-step counter ``step`` and the ``worker`` id, so a
sampled sequence can be checked to be consecutive and single-worker.
"""

import collections
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from dreamer_ver import replay as replaylib
from dreamer_ver.replay import chunk as chunklib


def fill(replay, steps, workers=1, extra=None):
  """Adds ``steps`` steps for each worker, interleaved step by step."""
  for step in range(steps):
    for worker in range(workers):
      data = {'step': np.int64(step), 'worker': np.int64(worker)}
      if extra:
        data.update(extra(worker, step))
      replay.add(data, worker)


def expected_items(steps, workers, length, capacity):
  """(worker, start) of the items left after ``fill``, oldest first."""
  items = []
  for step in range(steps):
    for worker in range(workers):
      if step >= length - 1:
        items.append((worker, step - length + 1))
  return items[-capacity:] if capacity else items


def starts(batch):
  pairs = zip(batch['worker'][:, 0], batch['step'][:, 0])
  return {(int(worker), int(step)) for worker, step in pairs}


def file_lengths(directory):
  """Row counts of the chunk files in a directory, from their names."""
  return [chunklib.parse_filename(p.name)[3] for p in directory.glob('*.npz')]


def latent(worker, step):
  return np.full(3, 1000 * worker + step, np.float32)


def test_does_not_import_jax_or_agent():
  names = ('jax', 'dreamer_ver.agent', 'dreamer_ver.runtime')
  code = (
      'import sys, dreamer_ver.replay; '
      f'print([n for n in {names!r} if n in sys.modules])')
  out = subprocess.run(
      [sys.executable, '-c', code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == '[]', out.stdout


class TestStorage:

  def test_sample_keeps_shapes_drops_log_keys_and_adds_unique_stepids(self):
    replay = replaylib.Replay(length=5, capacity=10)
    for step in range(30):
      replay.add({
          'image': np.full((8, 8, 3), step, np.uint8),
          'action': np.zeros(4, np.float32),
          'log/ignored': 1.0,
          'step': step})
    batch = replay.sample(3)
    assert set(batch) == {'image', 'action', 'step', 'stepid', 'consec'}
    assert batch['image'].shape == (3, 5, 8, 8, 3)
    assert batch['image'].dtype == np.uint8
    assert batch['stepid'].shape == (3, 5, 20)
    assert batch['stepid'].dtype == np.uint8
    assert batch['consec'].dtype == np.int32
    assert (batch['consec'] == 0).all()
    assert (batch['image'][:, :, 0, 0, 0] == batch['step']).all()
    # Step ids are unique per step and their last 4 bytes count rows.
    ids = {row.tobytes() for row in batch['stepid'].reshape(-1, 20)}
    assert len(ids) == len(set(batch['step'].reshape(-1).tolist()))
    rows = batch['stepid'][..., 16:].astype(np.int64) @ (
        256 ** np.arange(3, -1, -1))
    assert (rows == batch['step'] % 1024).all()

  @pytest.mark.parametrize('length,workers,capacity', [
      (1, 1, 1), (2, 1, 2), (5, 1, 10), (1, 2, 2), (5, 3, 15), (2, 7, 20)])
  def test_size_stops_at_capacity_and_stats_count_inserts_and_evictions(self, length, workers, capacity):
    replay = replaylib.Replay(length, capacity, chunksize=4)
    for step in range(30):
      for worker in range(workers):
        replay.add({'step': step}, worker)
      target = min(workers * max(0, step + 2 - length), capacity)
      assert len(replay) == target
    stats = replay.stats()
    inserts = workers * (30 - length + 1)
    assert stats['inserts'] == inserts
    assert stats['evicted'] == inserts - capacity
    assert stats['adds'] == 30 * workers

  @pytest.mark.parametrize('length,workers,capacity,chunksize', [
      (1, 1, 1, 128), (2, 1, 2, 128), (5, 1, 10, 128), (1, 2, 2, 128),
      (5, 3, 15, 128), (2, 7, 20, 128), (7, 2, 27, 4), (9, 3, 40, 2),
      (4, 2, 30, 1)])
  def test_sampled_sequences_are_consecutive_steps_of_one_worker(
      self, length, workers, capacity, chunksize):
    replay = replaylib.Replay(length, capacity, chunksize=chunksize)
    fill(replay, 30, workers)
    batch = replay.sample(64)
    offsets = batch['step'] - batch['step'][:, :1]
    assert (offsets == np.arange(length)).all()
    assert (batch['worker'] == batch['worker'][:, :1]).all()
    allowed = set(expected_items(30, workers, length, capacity))
    assert starts(batch) <= allowed

  def test_memory_freed_after_eviction(self):
    replay = replaylib.Replay(length=5, capacity=12, chunksize=4)
    fill(replay, 500, workers=2)
    stats = replay.stats()
    assert stats['items'] == 12
    # Each worker keeps its 6 newest items plus 4 pending steps, 10 steps in
    # at most 4 chunks of 4 (and maybe an empty open one).
    assert stats['chunks'] <= 2 * 4
    assert stats['steps'] <= 2 * 12
    assert stats['chunks_freed'] >= 2 * (500 // 4) - 8

  @pytest.mark.parametrize(
      'length,capacity', [(1, 1), (2, 2), (5, 10), (3, 20)])
  def test_sample_repeats_the_only_stored_item(self, length, capacity):
    replay = replaylib.Replay(length, capacity)
    fill(replay, length)
    batch = replay.sample(10)
    assert (batch['step'] == np.arange(length)).all()

  def test_items_are_sampled_uniformly_by_default(self):
    replay = replaylib.Replay(length=5, capacity=20, seed=0)
    fill(replay, 7)
    assert len(replay) == 3
    counts = collections.Counter(replay.sample(600)['step'][:, 0].tolist())
    assert sorted(counts) == [0, 1, 2]
    assert all(150 < count < 250 for count in counts.values()), counts

  def test_interleaved_workers_form_separate_sequences(self):
    replay = replaylib.Replay(length=2, capacity=20)
    replay.add({'step': 0}, worker=0)
    replay.add({'step': 1}, worker='b')
    replay.add({'step': 2}, worker=0)
    replay.add({'step': 3}, worker='b')
    seqs = {tuple(row) for row in replay.sample(50)['step'].tolist()}
    assert seqs == {(0, 2), (1, 3)}

  def test_workers_adding_in_random_order_keep_sequences_apart(self):
    rng = np.random.default_rng(0)
    replay = replaylib.Replay(length=4, capacity=30, chunksize=3)
    counters = [0, 0, 0]
    for _ in range(60):
      worker = int(rng.integers(0, 3))
      replay.add({'step': counters[worker], 'worker': worker}, worker)
      counters[worker] += 1
    batch = replay.sample(100)
    assert (batch['step'] - batch['step'][:, :1] == np.arange(4)).all()
    assert (batch['worker'] == batch['worker'][:, :1]).all()
    assert set(batch['worker'][:, 0].tolist()) == {0, 1, 2}

  def test_sample_sets_is_first_at_start_and_is_last_before_an_episode_start(self):
    replay = replaylib.Replay(length=4, capacity=10)
    for step in range(4):
      replay.add({'step': step, 'is_first': step == 2, 'is_last': False})
    batch = replay.sample(1)
    assert batch['is_first'][0].tolist() == [True, False, True, False]
    assert batch['is_last'][0].tolist() == [False, True, False, False]
    # The stored rows are unchanged.
    again = replay.sample(1)
    assert again['is_first'][0].tolist() == [True, False, True, False]

  def test_sample_times_out_while_no_full_sequence_is_stored(self):
    replay = replaylib.Replay(length=3, capacity=10)
    replay.add({'step': 0})
    with pytest.raises(TimeoutError):
      replay.sample(1, timeout=0.05)

  def test_sample_waits_for_first_item(self):
    replay = replaylib.Replay(length=2, capacity=10)
    replay.add({'step': 0})
    timer = threading.Timer(0.05, lambda: replay.add({'step': 1}))
    timer.start()
    batch = replay.sample(2, timeout=5)
    assert (batch['step'] == [[0, 1], [0, 1]]).all()


class TestInputChecking:

  def make(self):
    replay = replaylib.Replay(length=2, capacity=10, chunksize=4)
    for step in range(3):
      replay.add({'obs': np.full(3, step, np.float32), 'step': step})
    return replay

  @pytest.mark.parametrize('step,words', [
      ({'obs': np.zeros(4, np.float32), 'step': 9}, ["'obs'", '(3,)', '(4,)']),
      ({'obs': np.zeros(3, np.float64), 'step': 9},
       ["'obs'", 'float32', 'float64']),
      ({'obs': np.zeros(3, np.float32)}, ['missing', "'step'"]),
      ({'obs': np.zeros(3, np.float32), 'step': 9, 'new': 1},
       ['unexpected', "'new'"]),
  ])
  def test_mismatch_rejected_and_data_untouched(self, step, words):
    replay = self.make()
    before = replay.stats()
    with pytest.raises(ValueError) as info:
      replay.add(step)
    for word in words:
      assert word in str(info.value)
    after = replay.stats()
    assert after['adds'] == before['adds'] and len(replay) == 2
    # The stream continues exactly where it was.
    replay.add({'obs': np.full(3, 3, np.float32), 'step': 3})
    batch = replay.sample(50)
    assert (batch['step'][:, 1] - batch['step'][:, 0] == 1).all()
    assert (batch['obs'][..., 0] == batch['step']).all()
    assert set(batch['step'][:, 0].tolist()) == {0, 1, 2}

  def test_object_and_non_dict_rejected(self):
    replay = replaylib.Replay(length=2, capacity=10)
    with pytest.raises(ValueError, match='object'):
      replay.add({'x': np.array([{}, 1], dtype=object)})
    with pytest.raises(TypeError):
      replay.add([1, 2])
    assert replay.spec is None

  def test_given_stepid_and_consec_are_replaced_by_generated_ones(self):
    replay = replaylib.Replay(length=1, capacity=10)
    replay.add({'x': 1, 'stepid': np.zeros(20, np.uint8), 'consec': 5})
    batch = replay.sample(1)
    assert batch['stepid'].any() and (batch['consec'] == 0).all()


class TestUpdate:

  def make(self, capacity=50, chunksize=4):
    replay = replaylib.Replay(length=6, capacity=capacity, chunksize=chunksize)
    fill(replay, 20, workers=2, extra=lambda w, s: {'deter': latent(w, s)})
    return replay

  def test_write_back_visible_in_next_sample(self):
    replay = self.make()
    batch = replay.sample(4)
    new = -batch['deter'] - 1
    written = replay.update({'stepid': batch['stepid'], 'deter': new})
    assert written == 4 * 6
    updated = {
        sid.tobytes(): value for sid, value in zip(
            batch['stepid'].reshape(-1, 20), new.reshape(-1, 3))}
    seen = 0
    for _ in range(5):
      again = replay.sample(32)
      for sid, value, worker, step in zip(
          again['stepid'].reshape(-1, 20), again['deter'].reshape(-1, 3),
          again['worker'].reshape(-1), again['step'].reshape(-1)):
        if sid.tobytes() in updated:
          np.testing.assert_array_equal(value, updated[sid.tobytes()])
          seen += 1
        else:
          np.testing.assert_array_equal(value, latent(worker, step))
    assert seen > 0
    assert replay.stats()['updates'] == 24

  def test_evicted_steps_skipped_and_counted(self):
    replay = self.make(capacity=10)
    batch = replay.sample(3)
    # Push everything sampled out of the buffer.
    fill(replay, 40, workers=2,
         extra=lambda w, s: {'deter': latent(w, 100 + s)})
    written = replay.update(
        {'stepid': batch['stepid'], 'deter': np.zeros((3, 6, 3), np.float32)})
    assert written == 0
    stats = replay.stats()
    assert stats['updates_skipped'] == 18 and stats['updates'] == 0
    again = replay.sample(20)
    assert (again['deter'] != 0).all()

  def test_malformed_updates_and_unknown_sample_mode_are_rejected(self):
    replay = self.make()
    batch = replay.sample(2)
    with pytest.raises(ValueError, match='not a stored key'):
      replay.update({'stepid': batch['stepid'], 'other': batch['deter']})
    with pytest.raises(ValueError, match='expected shape'):
      replay.update(
          {'stepid': batch['stepid'], 'deter': batch['deter'][..., :2]})
    with pytest.raises(ValueError, match='stepid'):
      replay.update({'deter': batch['deter']})
    with pytest.raises(ValueError, match='not a stored key'):
      replay.update({'stepid': batch['stepid'], 'stepid2': batch['stepid']})
    with pytest.raises(ValueError, match='priority'):
      replay.update({'stepid': batch['stepid'], 'priority': np.ones(2)})
    with pytest.raises(ValueError, match='mode'):
      replay.sample(1, mode='other')
    assert replay.stats()['updates'] == 0

  def test_item_weight_is_mean_of_updated_step_priorities(self):
    selector = replaylib.Prioritized(seed=0)
    replay = replaylib.Replay(length=2, capacity=10, selector=selector)
    fill(replay, 4)  # Items start at steps 0, 1, 2.
    batch = replay.sample(30)
    priority = (batch['step'][:, 0:1] == 0).astype(np.float64)
    priority = np.repeat(priority, 2, axis=1)
    replay.update({'stepid': batch['stepid'], 'priority': priority})
    # Step 1 is shared by the items at 0 and 1; set it back to one.
    step1 = batch['stepid'][batch['step'] == 1][:1]
    replay.update({'stepid': step1[None], 'priority': np.ones((1, 1))})
    counts = collections.Counter(replay.sample(400)['step'][:, 0].tolist())
    # Weights (mean of step priorities): item 0: (1+1)/2, item 1: (1+0)/2,
    # item 2: (0+0)/2.
    assert counts[2] == 0
    assert 0.55 < counts[0] / 400 < 0.78, counts


class TestOnline:

  def test_fresh_sequences_sampled_first(self):
    replay = replaylib.Replay(length=3, capacity=100, online=True, seed=1)
    fill(replay, 10)  # Items start at 0..7; queued: 0, 3, 6.
    assert replay.stats()['online_queue'] == 3
    report = replay.sample(5, mode='report')
    assert replay.stats()['online_queue'] == 3
    assert report['step'].shape == (5, 3)
    batch = replay.sample(3)
    assert batch['step'][:, 0].tolist() == [0, 3, 6]
    assert replay.stats()['samples_online'] == 3
    replay.add({'step': 10, 'worker': 0})
    replay.add({'step': 11, 'worker': 0})
    assert replay.sample(1)['step'][0, 0] == 9

  def test_online_queue_drops_evicted_items(self):
    replay = replaylib.Replay(length=2, capacity=4, online=True)
    fill(replay, 50)
    # Only queued items that are still stored remain queued.
    assert replay.stats()['online_queue'] <= 2
    assert replay.sample(1)['step'][0, 0] >= 45


class TestSaveLoad:

  @pytest.mark.parametrize('length,capacity,chunksize,workers', [
      (1, 1, 128, 1), (3, 10, 4, 1), (5, 25, 2, 1), (4, 30, 4, 3),
      (5, 100, 16, 2)])
  def test_restored_replay_has_same_items_data_and_stepids(self, tmp_path, length, capacity, chunksize,
                             workers):
    extra = lambda w, s: {'deter': latent(w, s), 'flag': s % 3 == 0}
    replay = replaylib.Replay(
        length, capacity, directory=tmp_path, chunksize=chunksize)
    fill(replay, 30, workers, extra)
    replay.save(wait=True)
    restored = replaylib.Replay(
        length, capacity, directory=tmp_path, chunksize=chunksize)
    assert restored.load() == len(replay)
    assert len(restored) == len(replay)
    assert restored.spec == replay.spec
    want = set(expected_items(30, workers, length, capacity))
    seen = set()
    for _ in range(4):
      batch = restored.sample(2 * capacity)
      assert (batch['step'] - batch['step'][:, :1] == np.arange(length)).all()
      for row in range(len(batch['step'])):
        worker, step = batch['worker'][row], batch['step'][row]
        np.testing.assert_array_equal(
            batch['deter'][row], np.stack([latent(worker[0], s) for s in step]))
        np.testing.assert_array_equal(batch['flag'][row], step % 3 == 0)
      seen |= starts(batch)
    assert seen == want
    # Step ids survive, so updates from before the restart still land.
    old = replay.sample(2)
    assert restored.update(
        {'stepid': old['stepid'], 'deter': old['deter'] + 0.5}) == 2 * length
    replay.close()
    restored.close()

  @pytest.mark.parametrize('every', [2, 7, 25])
  def test_restore_exact_with_uneven_workers(self, tmp_path, every):
    # Worker 0 adds one step for every ``every`` steps of worker 1, so its
    # newest items sit in chunks created long before worker 1's newest.
    replay = replaylib.Replay(4, 30, directory=tmp_path, chunksize=4, seed=1)
    counters = [0, 0]
    for index in range(400):
      worker = 0 if index % every == 0 else 1
      replay.add({'step': counters[worker], 'worker': worker}, worker)
      counters[worker] += 1
    replay.save(wait=True)
    restored = replaylib.Replay(4, 30, directory=tmp_path, seed=2)
    assert restored.load() == 30
    ids = lambda r: {row.tobytes() for row in r.sample(3000)['stepid'][:, 0]}
    assert ids(restored) == ids(replay)
    assert len(ids(restored)) == 30

  def test_updates_and_growth_are_saved(self, tmp_path):
    replay = replaylib.Replay(4, 100, directory=tmp_path, chunksize=8)
    fill(replay, 10, extra=lambda w, s: {'deter': latent(w, s)})
    replay.save(wait=True)
    files = sorted(p.name for p in tmp_path.glob('*.npz'))
    assert [chunklib.parse_filename(name)[3] for name in files] == [8, 2]
    # The open chunk grows and one step gets a new latent.
    fill(replay, 3, extra=lambda w, s: {'deter': latent(w, 10 + s)})
    batch = replay.sample(1)
    replay.update({'stepid': batch['stepid'][:, :1],
                   'deter': np.full((1, 1, 3), -7, np.float32)})
    replay.save(wait=True)
    lengths = sorted(file_lengths(tmp_path))
    assert lengths == [5, 8]  # The partial file was replaced, not added to.
    restored = replaylib.Replay(4, 100, directory=tmp_path)
    restored.load()
    everything = restored.sample(200)
    target = batch['stepid'][0, 0].tobytes()
    hits = [value for sid, value in zip(
        everything['stepid'].reshape(-1, 20),
        everything['deter'].reshape(-1, 3))
        if sid.tobytes() == target]
    assert hits and all((value == -7).all() for value in hits)

  def test_evicted_chunk_files_are_deleted_also_after_a_restart(self, tmp_path):
    replay = replaylib.Replay(5, 12, directory=tmp_path, chunksize=4)
    for _ in range(10):
      fill(replay, 20, workers=2)
      replay.save(wait=True)
      files = list(tmp_path.glob('*.npz'))
      lengths = file_lengths(tmp_path)
      stats = replay.stats()
      # Exactly the stored chunks are on disk, no matter how much was added.
      assert sum(lengths) == stats['steps']
      assert len(files) <= stats['chunks'] <= 2 * 5
    assert stats['files_deleted'] > 0
    assert not list(tmp_path.glob('*.tmp'))
    # After a restart, the loaded chunks' files go once their items are
    # evicted. Files that the load did not need stay untouched.
    before = {p.name for p in tmp_path.glob('*.npz')}
    restored = replaylib.Replay(5, 12, directory=tmp_path, chunksize=4)
    restored.load()
    loaded = restored.stats()['chunks_loaded']
    assert 0 < loaded <= len(before)
    fill(restored, 30, workers=2)
    restored.save(wait=True)
    after = {p.name for p in tmp_path.glob('*.npz')}
    untouched = after & before
    assert len(untouched) == len(before) - loaded
    lengths = [chunklib.parse_filename(name)[3] for name in after - untouched]
    assert sum(lengths) == restored.stats()['steps']

  def test_load_newest_up_to_capacity(self, tmp_path):
    replay = replaylib.Replay(3, 1000, directory=tmp_path, chunksize=4)
    fill(replay, 40, workers=2)
    replay.save(wait=True)
    small = replaylib.Replay(3, 10, directory=tmp_path)
    assert small.load() >= 10
    assert len(small) == 10
    # Loading goes by chunks, so the items kept are the newest up to a chunk
    # per worker.
    newest = set(expected_items(40, 2, 3, 10 + 2 * 4))
    found = starts(small.sample(200))
    assert len(found) == 10 and found <= newest
    assert {worker for worker, _ in found} == {0, 1}
    # Only the chunks needed were read.
    assert small.stats()['chunks_loaded'] <= 2 * 3
    # Files that were not loaded are left alone.
    assert len(list(tmp_path.glob('*.npz'))) == 20

  def test_restored_replay_accepts_new_steps_and_samples_old_and_new(self, tmp_path):
    replay = replaylib.Replay(5, 25, directory=tmp_path, chunksize=2)
    fill(replay, 15)
    replay.save(wait=True)
    restored = replaylib.Replay(5, 25, directory=tmp_path, chunksize=2)
    restored.load()
    assert len(restored) == 11
    for step in range(15):
      restored.add({'step': np.int64(100 + step), 'worker': np.int64(0)})
    assert len(restored) == 22
    batch = restored.sample(300)
    assert (batch['step'] - batch['step'][:, :1] == np.arange(5)).all()
    assert {s < 100 for s in batch['step'][:, 0].tolist()} == {True, False}

  def test_corrupt_file_skipped(self, tmp_path, caplog):
    replay = replaylib.Replay(2, 100, directory=tmp_path, chunksize=4)
    fill(replay, 12)
    replay.save(wait=True)
    newest = sorted(tmp_path.glob('*.npz'))[-1]
    newest.write_bytes(b'not a zip file')
    restored = replaylib.Replay(2, 100, directory=tmp_path)
    restored.load()
    batch = restored.sample(100)
    assert set(batch['step'][:, 0].tolist()) == set(range(7))
    # One line that names the file and the cause, no traceback: a damaged
    # chunk is an expected fault.
    [record] = [r for r in caplog.records if 'unreadable' in r.message]
    assert record.exc_info is None
    message = record.getMessage()
    assert message.startswith(
        f'Skipping unreadable replay chunk {newest} (ValueError: ')
    assert '\n' not in message

  def test_structure_change_rejected_on_load(self, tmp_path):
    replay = replaylib.Replay(2, 100, directory=tmp_path)
    fill(replay, 5)
    replay.save(wait=True)
    other = replaylib.Replay(2, 100, directory=tmp_path)
    other.add({'different': 1.0})
    with pytest.raises(ValueError, match='holds'):
      other.load()


class TestChunk:

  def test_chunk_roundtrips_through_npz_without_pickle(self, tmp_path):
    chunk = chunklib.Chunk(5)
    for step in range(3):
      chunk.append({
          'dyn/deter': np.full(2, step, np.float32), 'file': np.int32(step),
          'name': np.str_('ab'[step % 2])})
    chunk.succ = chunklib.new_uuid()
    path = chunk.save(tmp_path)
    stamp, uuid, succ, length = chunklib.parse_filename(path.name)
    assert (uuid, succ, length) == (chunk.uuid, chunk.succ, 3)
    with np.load(path, allow_pickle=False) as archive:
      assert sorted(archive.files) == ['__time__', 'dyn/deter', 'file', 'name']
      assert (np.diff(archive['__time__']) > 0).all()
    loaded = chunklib.Chunk.load(path)
    assert loaded.uuid == chunk.uuid and loaded.succ == chunk.succ
    assert loaded.length == 3 and loaded.time == chunk.time == stamp
    for key in chunk.data:
      np.testing.assert_array_equal(loaded.data[key], chunk.data[key][:3])

  def test_filenames_sort_by_creation(self):
    chunks = [chunklib.Chunk(2) for _ in range(50)]
    names = [c.filename for c in chunks]
    assert sorted(names) == names

  def test_parse_filename_rejects_malformed_names(self):
    for name in ('x.npz', '1-2-3.npz', '1-ab-cd-3.npz', 'a.npy'):
      with pytest.raises(ValueError):
        chunklib.parse_filename(name)


class TestSumTree:

  def test_total_tracks_inserts_and_removals_and_capacity_grows(self):
    tree = replaylib.SumTree(initial_capacity=2)
    for key in range(50):
      assert tree.total == pytest.approx(sum(range(key)))
      tree.insert(key, key)
    for key in range(0, 50, 2):
      tree.remove(key)
    assert len(tree) == 25
    assert tree.total == pytest.approx(sum(range(1, 50, 2)))
    tree.update(1, 100)
    assert tree.weight(1) == 100
    for key in range(0, 50, 2):
      tree.insert(key, 1)
    assert len(tree) == 50 and tree.capacity == 64

  def test_keys_are_sampled_in_proportion_to_weight(self):
    tree = replaylib.SumTree(seed=0)
    weights = {0: 0, 1: 3, 2: 1, 3: 1, 4: 2, 5: 2e-9}
    for key, weight in weights.items():
      tree.insert(key, 100.0)
    for key, weight in weights.items():
      tree.update(key, weight)
    counts = collections.Counter(tree.sample() for _ in range(4000))
    assert counts[0] == 0
    total = sum(weights.values())
    for key in (1, 2, 3, 4):
      assert abs(counts[key] / 4000 - weights[key] / total) < 0.03, counts

  def test_zero_weight_keys_are_skipped_unless_all_are_zero(self):
    tree = replaylib.SumTree(seed=0)
    for key in range(30):
      tree.insert(key, 1.0 if key % 3 == 0 else 0.0)
    assert all(tree.sample() % 3 == 0 for _ in range(500))
    for key in range(0, 30, 3):
      tree.update(key, 0.0)
    counts = collections.Counter(tree.sample() for _ in range(3000))
    assert set(counts) == set(range(30))  # All zero: uniform over all.

  def test_infinite_weight_keys_are_sampled_uniformly_and_exclusively(self):
    tree = replaylib.SumTree(seed=0)
    for key in range(30):
      tree.insert(key, np.inf if key % 5 == 0 else 1e6)
    assert tree.infinite == 6 and np.isfinite(tree.total)
    counts = collections.Counter(tree.sample() for _ in range(1200))
    assert set(counts) == {0, 5, 10, 15, 20, 25}
    assert min(counts.values()) > 120
    for key in range(0, 30, 5):
      tree.remove(key)
    assert tree.sample() % 5 != 0 and tree.infinite == 0

  def test_negative_or_nan_weights_and_sampling_an_empty_tree_raise(self):
    tree = replaylib.SumTree()
    with pytest.raises(ValueError):
      tree.insert(0, -1)
    with pytest.raises(ValueError):
      tree.insert(0, np.nan)
    with pytest.raises(ValueError):
      tree.sample()


def stepids(*numbers):
  """Fake step ids: one [20] uint8 row per number."""
  return np.array([[0] * 16 + list(n.to_bytes(4, 'big')) for n in numbers],
                  np.uint8)


class TestSelectors:

  def test_uniform_samples_current_keys_evenly_after_removals(self):
    selector = replaylib.Uniform(seed=0)
    for key in range(10):
      selector[key] = None
    for key in (0, 9, 4):
      del selector[key]
    assert len(selector) == 7
    counts = collections.Counter(selector() for _ in range(1400))
    assert set(counts) == {1, 2, 3, 5, 6, 7, 8}
    assert all(130 < count < 270 for count in counts.values()), counts

  def test_prioritized_samples_items_by_mean_step_priority(self):
    selector = replaylib.Prioritized(seed=0)
    selector['a'] = stepids(0, 1)
    selector['b'] = stepids(1, 2)
    selector['c'] = stepids(3, 4)
    selector.prioritize(stepids(0, 1, 2, 3, 4), [3, 1, 0, 2, 2])
    counts = collections.Counter(selector() for _ in range(3000))
    # Item weights: a = 2, b = 0.5, c = 2.
    for key, weight in (('a', 2), ('b', 0.5), ('c', 2)):
      assert abs(counts[key] / 3000 - weight / 4.5) < 0.03, counts

  def test_prioritized_weight_mixes_max_and_mean_of_powered_priorities(self):
    selector = replaylib.Prioritized(exponent=2, maxfrac=0.5, initial=np.inf)
    selector['new'] = stepids(0, 1)
    assert selector.tree.weight('new') == np.inf
    selector.prioritize(stepids(0, 1), [1, 3])
    # 0.5 * max(1, 9) + 0.5 * mean(1, 9)
    assert selector.tree.weight('new') == pytest.approx(7.0)
    selector.prioritize(stepids(7), [5])  # Unknown step: ignored.
    assert selector.ignored == 1
    del selector['new']
    assert len(selector) == 0 and not selector.powered

  def test_zero_on_sample_stops_a_drawn_item_being_drawn_again(self):
    selector = replaylib.Prioritized(zero_on_sample=True, seed=0)
    selector['a'] = stepids(0, 1)
    selector['b'] = stepids(2, 3)
    first = selector()
    second = selector()
    assert {first, second} == {'a', 'b'}

  def test_recency_weights_items_by_inverse_age_and_skips_holes(self):
    selector = replaylib.Recency(exponent=1.0, seed=0)
    for key in range(100):
      selector[key] = None
    for key in range(50):
      del selector[key]
    counts = collections.Counter(selector() for _ in range(4000))
    assert min(counts) >= 50
    # Ages 1 and 2 have weights 1 and 1/2.
    assert 1.6 < counts[99] / counts[98] < 2.5
    assert counts[99] > 5 * counts[60]
    # Holes from out-of-order removal are skipped.
    for key in range(60, 99):
      del selector[key]
    assert {selector() for _ in range(50)} <= {50, 51, 52, 53, 54, 55, 56, 57,
                                              58, 59, 99}

  def test_mixture_rejects_bad_fractions_and_drops_zero_fraction_selectors(self):
    with pytest.raises(ValueError):
      replaylib.Mixture({'u': replaylib.Uniform()}, {'u': 0.5})
    with pytest.raises(ValueError):
      replaylib.Mixture({'u': replaylib.Uniform()}, {'x': 1.0})
    mixture = replaylib.Mixture(
        {'uniform': replaylib.Uniform(seed=1),
         'recency': replaylib.Recency(exponent=3, seed=2),
         'priority': replaylib.Prioritized(seed=3)},
        {'uniform': 0.5, 'recency': 0.5, 'priority': 0.0}, seed=0)
    assert mixture.names == ['recency', 'uniform']
    assert not mixture.uses_stepids
    for key in range(20):
      mixture[key] = None
    del mixture[0]
    assert len(mixture) == 19
    counts = collections.Counter(mixture() for _ in range(2000))
    assert 0 not in counts
    # Recency with exponent 3 gives the newest item ~83% of its half.
    assert 0.38 < counts[19] / 2000 < 0.50, counts

  def test_replay_with_mixture_and_prioritized(self):
    selector = replaylib.Mixture(
        {'uniform': replaylib.Uniform(), 'priority': replaylib.Prioritized()},
        {'uniform': 0.5, 'priority': 0.5})
    replay = replaylib.Replay(3, 10, chunksize=2, selector=selector)
    fill(replay, 40, workers=2)
    batch = replay.sample(20)
    assert (batch['step'] - batch['step'][:, :1] == np.arange(3)).all()
    replay.update({'stepid': batch['stepid'], 'priority': np.ones((20, 3))})
    prioritized = selector.selectors[selector.names.index('priority')]
    assert len(prioritized) == 10 and len(prioritized.powered) <= 2 * (5 + 2)


class TestLimiter:

  def test_default_limiter_needs_2992_inserts_before_first_sample(self):
    limiter = replaylib.SamplesPerInsert(32 / 64, tolerance=64, minsize=1040)
    inserts = 0
    while not limiter.want_sample()[0]:
      assert limiter.want_insert()[0]
      limiter.insert()
      inserts += 1
    assert inserts == 2992

  def test_credit_starts_at_minsize_and_stays_within_tolerance(self):
    limiter = replaylib.SamplesPerInsert(2.0, tolerance=3, minsize=5)
    assert limiter.want_sample() == (False, 'too few steps: 0 < 5')
    limiter.insert(4)
    assert limiter.avail == -5 and not limiter.want_sample()[0]
    limiter.insert()  # Size reaches minsize: credit starts.
    assert limiter.avail == -3 and not limiter.want_sample()[0]
    limiter.insert()
    assert limiter.avail == -1 and limiter.want_sample()[0]
    limiter.insert(3)
    assert limiter.avail == 5 and limiter.want_insert()[0]
    limiter.insert()
    allowed, reason = limiter.want_insert()
    assert limiter.avail == 7 and not allowed and 'rate limited' in reason
    limiter.sample(9)
    assert limiter.avail == -2 and limiter.want_sample()[0]
    limiter.sample()
    assert not limiter.want_sample()[0] and limiter.want_insert()[0]

  def test_limiter_state_survives_save_and_load(self):
    limiter = replaylib.SamplesPerInsert(0.5, tolerance=2, minsize=3)
    limiter.insert(10)
    limiter.sample(2)
    state = limiter.save()
    assert state == {'size': 10, 'avail': -3 + 8 * 0.5 - 2}
    other = replaylib.SamplesPerInsert(0.5, tolerance=2, minsize=3)
    other.load(state)
    assert other.save() == state
    assert other.want_sample() == limiter.want_sample()

  def test_zero_ratio_and_unlimited_limiters_never_block(self):
    limiter = replaylib.SamplesPerInsert(0, tolerance=1, minsize=2)
    limiter.insert(1000)
    assert limiter.want_insert() == (True, 'unlimited')
    assert limiter.want_sample() == (True, 'unlimited')
    unlimited = replaylib.Unlimited()
    assert unlimited.want_sample()[0] and unlimited.want_insert()[0]


def test_concurrent_add_sample_update_and_save_stay_consistent(tmp_path):
  length, capacity = 5, 64
  replay = replaylib.Replay(
      length, capacity, directory=tmp_path, chunksize=8, online=True)
  running = threading.Event()
  running.set()
  added = collections.Counter()
  errors = []

  def adder(worker):
    step = 0
    try:
      while running.is_set():
        replay.add({'step': np.int64(step), 'worker': np.int64(worker),
                    'deter': latent(worker, step)}, worker)
        added[worker] += 1
        step += 1
        if step % 50 == 0:
          time.sleep(0.001)
    except Exception as error:  # pragma: no cover - reported below
      errors.append(error)

  def sampler():
    try:
      while running.is_set():
        batch = replay.sample(4, timeout=5)
        assert (batch['step'] - batch['step'][:, :1] == np.arange(length)).all()
        assert (batch['worker'] == batch['worker'][:, :1]).all()
        replay.update({'stepid': batch['stepid'], 'deter': batch['deter']})
    except Exception as error:  # pragma: no cover - reported below
      errors.append(error)

  threads = [threading.Thread(target=adder, args=(w,)) for w in range(3)]
  threads.append(threading.Thread(target=sampler))
  for thread in threads:
    thread.start()
  deadline = time.time() + 2.0
  while time.time() < deadline:
    replay.save()
    time.sleep(0.1)
    assert replay.load() == 0  # Everything on disk is in memory or freed.
    assert replay.stats()['items'] <= capacity
    time.sleep(0.1)
  running.clear()
  for thread in threads:
    thread.join()
  assert not errors, errors
  replay.save(wait=True)

  stats = replay.stats()
  inserts = sum(max(0, n - length + 1) for n in added.values())
  assert stats['adds'] == sum(added.values())
  assert stats['inserts'] == inserts
  assert len(replay) == min(inserts, capacity) == capacity
  assert stats['evicted'] == inserts - capacity
  assert stats['samples'] > 0 and stats['updates'] > 0
  assert sum(file_lengths(tmp_path)) == stats['steps']
  # The latents written back are the ones that were stored: still exact.
  batch = replay.sample(64, mode='report')
  for row in range(64):
    worker = batch['worker'][row, 0]
    expected = np.stack([latent(worker, s) for s in batch['step'][row]])
    np.testing.assert_array_equal(batch['deter'][row], expected)
  replay.close()
