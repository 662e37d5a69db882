"""A tiny debug agent's config, spaces and a random batch for it."""

import elements
import numpy as np

from dreamer_ver.config import loading as configlib
from dreamer_ver.agent import nets

f32 = np.float32


def small_config(**overrides):
  return configlib.compose(['debug'], overrides)


def vector_spaces():
  obs = {
      'vector': elements.Space(np.float32, (5,)),
      'reward': elements.Space(np.float32, ()),
      'is_first': elements.Space(bool, ()),
      'is_last': elements.Space(bool, ()),
      'is_terminal': elements.Space(bool, ()),
  }
  act = {'action': elements.Space(np.int32, (), 0, 3),
         'reset': elements.Space(bool, ())}
  return obs, act


def make_batch(agent, B, T, seed=0, random_latents=False):
  """A random [B, T] batch in the spaces' own ranges (discrete values from
  each space's low), episodes starting at step 0, with stored latents: zero,
  or random one-hot ones where `random_latents`."""
  rng = np.random.default_rng(seed)
  batch = {}
  for k, s in {**agent.obs_space, **agent.act_space}.items():
    if s.dtype == bool:
      batch[k] = np.zeros((B, T, *s.shape), bool)
    elif s.dtype == np.uint8:
      batch[k] = rng.integers(0, 256, (B, T, *s.shape)).astype(np.uint8)
    elif np.issubdtype(s.dtype, np.integer):
      batch[k] = (nets.class_low(s) + rng.integers(
          0, nets.num_classes(s), (B, T, *s.shape))).astype(s.dtype)
    else:
      batch[k] = rng.uniform(-1, 1, (B, T, *s.shape)).astype(s.dtype)
  batch['is_first'][:, 0] = True
  r = agent.config.agent.rssm
  batch['stepid'] = np.zeros((B, T, 20), np.uint8)
  batch['consec'] = np.zeros((B, T), np.int32)
  if random_latents:
    batch['dyn/deter'] = rng.uniform(-1, 1, (B, T, r.deter)).astype(f32)
    stoch = rng.integers(0, r.classes, (B, T, r.stoch))
    batch['dyn/stoch'] = np.eye(r.classes, dtype=f32)[stoch]
  else:
    batch['dyn/deter'] = np.zeros((B, T, r.deter), f32)
    batch['dyn/stoch'] = np.zeros((B, T, r.stoch, r.classes), f32)
  return batch
