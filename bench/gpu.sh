#!/bin/sh
# A GPU window in one command: installs what the machine lacks from the
# folders `bench/gpu_wheels.py` fills, then runs bench/gpu.py.
#
#   sh bench/gpu.sh --out DIR [bench/gpu.py's arguments]
set -e
cd "$(dirname "$0")/.."
if [ -d .gl ]; then  # EGL for MuJoCo's renderer, where the image lacks it
  for f in .gl/*.deb; do dpkg -x "$f" /; done
  ldconfig
fi
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD:$PYTHONPATH" MUJOCO_GL="${MUJOCO_GL:-egl}" \
  PYTHONUNBUFFERED=1
exec python3 bench/gpu.py "$@"
