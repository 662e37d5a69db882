"""A reader of an offline W&B run's transaction log, so tests check what
W&B would upload by value, without a W&B server."""

import json
import struct

BLOCK = 32 * 1024  # The log's block size; a record header never spans one.


def wandb_records(path):
  """The records of an offline W&B run's transaction log (`run-<id>.wandb`):
  a 7-byte file header, then LevelDB-log records (crc, length, type, data)
  in 32 KiB blocks, each a protobuf `Record`, maybe split over blocks."""
  from wandb.proto import wandb_internal_pb2
  data = path.read_bytes()
  assert data[:4] == b':W&B'
  position, parts = 7, b''
  while position + 7 <= len(data):
    if BLOCK - position % BLOCK < 7:  # The block's zero padding.
      position += BLOCK - position % BLOCK
      continue
    _, length, kind = struct.unpack('<IHB', data[position:position + 7])
    parts += data[position + 7:position + 7 + length]
    position += 7 + length
    if kind in (1, 4):  # FULL, or LAST of a split record.
      record = wandb_internal_pb2.Record()
      record.ParseFromString(parts)
      parts = b''
      yield record


def wandb_history(path):
  """{step: {key: value}} of the history rows of a W&B transaction log
  (nested keys, as of a logged video, joined with '.')."""
  history = {}
  for record in wandb_records(path):
    if record.WhichOneof('record_type') == 'history':
      history[record.history.step.num] = {
          '.'.join(item.nested_key) or item.key: json.loads(item.value_json)
          for item in record.history.item}
  return history


def wandb_run(path):
  (record,) = [r.run for r in wandb_records(path)
               if r.WhichOneof('record_type') == 'run']
  return record
