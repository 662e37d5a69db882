"""What the batch server queues: one Request per env row of a call, and the
Group that joins the rows of a multi-env call into its one reply."""

import dataclasses

import numpy as np


@dataclasses.dataclass(eq=False, slots=True)
class Request:
  """One queued call: who sent it, its number, its argument, when it came.

  `data` is the caller's dict of numpy arrays; the arrays are views into the
  transport's buffers, valid until the reply (copy to keep them, never
  write). `envid` is the integer under the server's `envid_key` when the
  request carries one, else `conn`. `transport` is the one it came through
  and replies go back by; `lane` is the index of the lane (and cutoff
  policy) that serves it.

  A call whose `envid` is a vector carries several envs (an env worker with
  `run.envs_per_worker > 1`): it is split into one Request per env, sharing
  a `group`, so the cutoff and the handler see every env as its own row. The
  caller gets one reply, the rows' replies stacked, once all rows are served.
  """
  conn: object
  reqnum: object
  data: dict
  arrival: float
  envid: object = None
  transport: object = None
  group: object = None
  index: int = 0
  lane: int = 0


class Group:
  """The rows of one multi-env call and their replies so far."""

  def __init__(self, envids):
    self.envids = envids
    self.replies = [None] * len(envids)
    self.missing = len(envids)

  def fill(self, index, reply):
    """Stores a row's reply; True once every row has one."""
    self.replies[index] = reply
    self.missing -= 1
    return self.missing == 0

  def result(self):
    """The stacked reply, or the first row's error for the whole call."""
    for reply in self.replies:
      if isinstance(reply, BaseException):
        return reply
    keys = self.replies[0].keys()
    return {k: np.stack([np.asarray(r[k]) for r in self.replies]) for k in keys}
