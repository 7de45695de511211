#!/usr/bin/env bash
# `make demo`: a local control plane, a virtual node with the mock provider, an example Deployment.
# `make demo-down` (this script with "down") stops all of it.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
STATE=.demo
mkdir -p "$STATE"

if [ "${1:-up}" = down ]; then
  if [ -f "$STATE/agent.pid" ]; then kill "$(cat "$STATE/agent.pid")" 2>/dev/null || true; fi
  rm -f "$STATE/agent.pid"
  "$BIN/vkubelet" dev cluster down --name demo || true
  exit 0
fi

"$BIN/vkubelet" dev cluster status --name demo >/dev/null 2>&1 || "$BIN/vkubelet" dev cluster up --name demo
KUBECONFIG=$("$BIN/python" -c 'from vkubelet.devcluster import Cluster; print(Cluster("demo").kubeconfig)')
export KUBECONFIG

if [ -f "$STATE/agent.pid" ] && kill -0 "$(cat "$STATE/agent.pid")" 2>/dev/null; then
  echo "vkubelet agent already running (pid $(cat "$STATE/agent.pid"))"
else
  nohup "$BIN/vkubelet" run --provider mock --provider-config examples/mock.json \
    --nodename vk-mock-0 >"$STATE/agent.log" 2>&1 &
  echo $! >"$STATE/agent.pid"
  echo "vkubelet agent started (pid $!, log $STATE/agent.log)"
fi

for _ in $(seq 1 60); do "$BIN/kubectl" get node vk-mock-0 >/dev/null 2>&1 && break; sleep 1; done
"$BIN/kubectl" wait --for=condition=Ready node/vk-mock-0 --timeout=60s
"$BIN/kubectl" apply -f examples/deployment.yaml
"$BIN/kubectl" rollout status deployment/hello-virtual --timeout=60s

cat <<MSG

vkubelet demo is running: a local cluster, the virtual node vk-mock-0 (mock provider) and a Deployment.
Try:
  export KUBECONFIG=$KUBECONFIG PATH=$PWD/$BIN:\$PATH
  kubectl get nodes -o wide
  kubectl get pods -o wide
  kubectl describe node vk-mock-0
  kubectl scale deployment hello-virtual --replicas=10
  tail -f $STATE/agent.log
Stop everything: make demo-down
MSG
