#!/usr/bin/env bash
# Starts one run as separate OS processes, each component with its own
# `--script`, talking over explicit host:port addresses: the multi-host
# recipe, run on this machine's loopback. See launch/README.md.
#
#   launch/local.sh LOGDIR [--configs ...] [--key value ...]
#
# Exits with the agent's status once it stops (at run.steps, or Ctrl-C),
# after stopping the env fleet, the replay and the logger.
set -uo pipefail
logdir=${1:?usage: launch/local.sh LOGDIR [flags...]}
shift
py=${PYTHON:-python3}
port() { "$py" -c 'from dreamer_ver.rpc.addresses import free_port; print(free_port())'; }
host=${HOST:-localhost}
addrs=(--run.actor_addr "$host:$(port)" --run.replay_addr "$host:$(port)"
       --run.logger_addr "$host:$(port)")
flags=(--logdir "$logdir" "${addrs[@]}" "$@")

pids=()
start() { "$py" -m dreamer_ver.main --script "$1" "${flags[@]}" & pids+=($!); }
stop() { kill -TERM "$@" 2>/dev/null; wait "$@" 2>/dev/null; }
trap 'stop "${pids[@]}"; exit 130' INT TERM

start parallel_logger
logger=${pids[-1]}
start parallel_replay
replay=${pids[-1]}
start parallel_envs
envs=${pids[-1]}
"$py" -m dreamer_ver.main --script parallel_agent \
  --run.remote_envs True --run.remote_replay True "${flags[@]}" &
agent=$!
pids+=($agent)
wait "$agent"
status=$?
stop "$envs"
stop "$replay" "$logger"
exit $status
