"""Replay buffer library (plain numpy): chunked storage, selectors, limiter.

``Replay`` stores steps per worker and samples fixed-length sequences;
``selectors`` decide which sequence is sampled; ``SamplesPerInsert`` holds
the ratio of sampled sequences to inserted steps.
"""

from .chunk import Chunk
from .limiter import SamplesPerInsert, Unlimited
from .replay import Replay, STEPID_BYTES
from .selectors import Mixture, Prioritized, Recency, Uniform
from .sumtree import SumTree

__all__ = [
    'Chunk', 'Mixture', 'Prioritized', 'Recency', 'Replay', 'STEPID_BYTES',
    'SamplesPerInsert', 'SumTree', 'Uniform', 'Unlimited',
]
