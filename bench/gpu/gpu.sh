#!/bin/sh
# A GPU window in one command: installs what the machine lacks from the
# folders `bench/gpu/gpu_wheels.py` fills, then runs bench/gpu/gpu.py.
#
#   sh bench/gpu/gpu.sh --out DIR [bench/gpu/gpu.py's arguments]
set -e
cd "$(dirname "$0")/../.."
if [ -d .gl ]; then  # EGL for MuJoCo's renderer, where the image lacks it
  for f in .gl/*.deb; do dpkg -x "$f" /; done
  ldconfig
fi
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
# MuJoCo renders through EGL where the machine has it (upstream's dmc
# wrapper renders every step); elsewhere rendering is off, not an error at
# import for the stages that never render.
if [ -z "$MUJOCO_GL" ]; then
  if ldconfig -p | grep -q 'libEGL\.so'; then MUJOCO_GL=egl
  else MUJOCO_GL=disable; fi
fi
export PYTHONPATH="$PWD:$PYTHONPATH" MUJOCO_GL \
  PYTHONUNBUFFERED=1
exec python3 -m bench.gpu.gpu "$@"
