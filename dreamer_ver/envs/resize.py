"""Image resizing without OpenCV, matching Pillow's bilinear filter.

Upstream resizes Atari frames with Pillow's bilinear filter. Pillow is not a
dependency of this package, so when it is missing we compute the same
filter in numpy: Pillow's bilinear resize is a separable, antialiased
triangle filter whose width grows with the downscaling factor, applied one
axis at a time with rounding to uint8 in between. Results agree with Pillow
exactly or, for some shapes where Pillow runs the passes in the other
order, to within one intensity level.
"""

import functools

import numpy as np

try:
  from PIL import Image as _Image
except ImportError:
  _Image = None


def resize(image, size, backend='auto'):
  """Resizes a uint8 (H, W, C) image to ``size`` = (height, width).

  ``backend`` is 'pillow', 'numpy', or 'auto' (Pillow when installed).
  """
  image = np.asarray(image)
  size = (int(size[0]), int(size[1]))
  if image.shape[:2] == size:
    return image
  if backend == 'auto':
    backend = 'pillow' if _Image is not None else 'numpy'
  if backend == 'pillow':
    if _Image is None:
      raise ImportError("resize backend 'pillow' needs the Pillow package.")
    squeeze = image.ndim == 3 and image.shape[2] == 1
    pic = _Image.fromarray(image[..., 0] if squeeze else image)
    out = np.asarray(pic.resize(size[::-1], _Image.BILINEAR))
    return out[..., None] if squeeze else out
  if backend != 'numpy':
    raise ValueError(f'Unknown resize backend: {backend}')
  if image.dtype != np.uint8:
    raise TypeError(f'Expected a uint8 image, got {image.dtype}')
  out = image.reshape(image.shape[:2] + (-1,)).astype(np.float64)
  for axis in (1, 0):  # Width first, as Pillow does.
    if out.shape[axis] == size[axis]:
      continue
    index, weights = _taps(out.shape[axis], size[axis])
    out = np.moveaxis(out, axis, 0)
    # Gather the few taps of each output pixel rather than multiplying by a
    # dense matrix: no BLAS call, whose threading is slow for small images.
    # Every product and sum is an integer below 2**53, so float64 is exact.
    out = np.einsum('ok,ok...->o...', weights, out[index])
    out = np.floor((out + 2**21) / 2**22)
    out = np.moveaxis(np.clip(out, 0, 255), 0, axis)
  return out.astype(np.uint8).reshape(size + image.shape[2:])


@functools.lru_cache(maxsize=16)
def _taps(src, dst):
  """Input indices and Pillow's fixed-point triangle-filter weights.

  Returns (dst, taps) arrays; unused taps have weight 0. Weights are scaled
  by 2**22 and rounded, as Pillow does for 8-bit images.
  """
  scale = src / dst
  stretch = max(scale, 1.0)  # Widen the filter when downscaling.
  rows = []
  for i in range(dst):
    center = (i + 0.5) * scale
    lo = max(int(center - stretch + 0.5), 0)
    hi = min(int(center + stretch + 0.5), src)
    taps = np.arange(lo, hi)
    w = np.maximum(0.0, 1.0 - np.abs((taps - center + 0.5) / stretch))
    rows.append((taps, np.floor(w / w.sum() * 2**22 + 0.5)))
  width = max(len(t) for t, _ in rows)
  index = np.zeros((dst, width), np.int64)
  weights = np.zeros((dst, width))
  for i, (taps, w) in enumerate(rows):
    index[i, :len(taps)] = taps
    weights[i, :len(taps)] = w
  return index, weights
