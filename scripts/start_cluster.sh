#!/usr/bin/env bash
# Start (or join) the Ray cluster an agentrl plan runs on. Run it on every node:
#
#   head (a training node):        scripts/start_cluster.sh head  train     [GPUS]
#   other training nodes:          scripts/start_cluster.sh HEAD_IP train   [GPUS]
#   inference nodes:               scripts/start_cluster.sh HEAD_IP inference [GPUS]
#
# then, on the head:  launchers/run_glm5_2_daytona.py train --num-nodes N --set cluster.ray_address=HEAD_IP:6379
# (`train --dry-run` lists how many nodes of each role the plan needs; `train` refuses a cluster that
# lacks them and prints these lines.)
#
# Token authentication is on (RAY_AUTH_MODE=token): the head writes the cluster's token to
# $RAY_AUTH_TOKEN_PATH (default ~/.ray/auth_token; put it on storage every node reads, or copy the
# file to each node before it joins). Ports that must be open between nodes: 6379 (GCS), the
# raylet/object-manager ports Ray picks (set --node-manager-port/--object-manager-port and a
# worker port range if a firewall sits between nodes), 8265 (dashboard, head only; reach it with an
# SSH tunnel), and the engines' HTTP ports (rollout.sglang.base_port + 10 k) and weight-update
# rendezvous ports from the inference nodes to the training nodes.
set -euo pipefail

where="${1:?usage: start_cluster.sh head|HEAD_IP train|inference [GPUS]}"
role="${2:?usage: start_cluster.sh head|HEAD_IP train|inference [GPUS]}"
gpus="${3:-$(nvidia-smi -L 2>/dev/null | wc -l)}"
case "$role" in
  train) resource=agentrl_train ;;
  inference) resource=agentrl_inference ;;
  *) echo "error: role must be train or inference, got '$role'" >&2; exit 2 ;;
esac
export RAY_AUTH_MODE=token
export RAY_USAGE_STATS_ENABLED=0
token_file="${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}"

if [ "$where" = head ]; then
  if [ ! -s "$token_file" ]; then
    mkdir -p "$(dirname "$token_file")"
    (umask 077; ray get-auth-token --generate > "$token_file")
    echo "start_cluster: wrote the cluster's token to $token_file; every node (and the driver) needs it" >&2
  fi
  export RAY_AUTH_TOKEN_PATH="$token_file"
  exec ray start --head --port 6379 --num-gpus "$gpus" --resources "{\"$resource\": 1000}" \
    --dashboard-host 127.0.0.1 --dashboard-port 8265
fi
if [ ! -s "$token_file" ]; then
  echo "error: no cluster token at $token_file; copy the head's token there (or set RAY_AUTH_TOKEN_PATH)" >&2
  exit 2
fi
export RAY_AUTH_TOKEN_PATH="$token_file"
exec ray start --address "$where:6379" --num-gpus "$gpus" --resources "{\"$resource\": 1000}"
