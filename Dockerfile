# The README's main job in a container (CPU):
#   docker build -t dreamer-ver .
#   docker run --rm -v "$PWD/runs:/runs" dreamer-ver
# Any other run: docker run --rm -v "$PWD/runs:/runs" dreamer-ver --script parallel --configs debug --logdir /runs/debug
# CUDA: docker build --build-arg EXTRAS=cuda,plot -t dreamer-ver:cuda . and
# docker run --gpus all ...: JAX's CUDA 12 wheels bring their own CUDA
# libraries, the host needs only the NVIDIA driver and container toolkit.
# dm_control tasks: add dmc to EXTRAS (and MUJOCO_GL=egl with a GPU, or
# osmesa with apt's libosmesa6 on CPU, for rendered frames).
FROM python:3.11-slim
ARG EXTRAS=plot
ENV PYTHONUNBUFFERED=1
WORKDIR /src
COPY pyproject.toml README.md LICENSE constraints.txt ./
COPY configs ./configs
COPY dreamer_ver ./dreamer_ver
RUN pip install --no-cache-dir -c constraints.txt ".[${EXTRAS}]"
WORKDIR /runs
# SIGTERM makes every component save before it exits (use docker stop -t 60:
# Docker's default 10 s can cut the saves short); the same command with the
# same logdir resumes.
STOPSIGNAL SIGTERM
ENTRYPOINT ["dreamer-ver"]
CMD ["--script", "parallel", "--configs", "cartpole", "--logdir", "/runs/cartpole"]
