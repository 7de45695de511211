#!/usr/bin/env bash
# `make demo`: a local control plane, a virtual node with the mock provider, an example Deployment.
# `make demo-down` (this script with "down") stops all of it.
#
# The apiserver refuses to proxy `nodes/<name>/proxy/...` (kubectl get --raw .../proxy/stats/summary)
# to a loopback address, so as root the node gets an address of its own on an interface the demo
# creates: a veth pair (vkdemo0, vkdemo1) with the address on one end. Traffic to a local address
# is delivered locally, so nothing leaves this machine, no namespace or route is needed, and one
# `ip link del` removes both ends. (A `dummy` interface would do, but its kernel module is often
# missing in containers and CI; veth is always there where containers run.)
# Without root the node uses 127.0.0.1: everything but the node-proxy paths works.
set -euo pipefail
shopt -s inherit_errexit  # a failing step inside $(...) stops the script too
cd "$(dirname "$0")/.."
BIN=.venv/bin
STATE=.demo
NODE=vk-mock-0
LINK=vkdemo0
PEER=vkdemo1
# Addresses tried for the node, in order: the first one no route on this machine covers yet
# (outside 10.250.0-249.x, which the tests' local_test_address() takes).
CANDIDATES=(10.250.254.1 10.250.253.1 172.31.254.1 192.168.254.1)
mkdir -p "$STATE"

stop_agent() {
  [ -f "$STATE/agent.pid" ] || return 0
  local pid
  pid=$(cat "$STATE/agent.pid")
  if kill "$pid" 2>/dev/null; then
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$STATE/agent.pid"
}

remove_address() {
  [ -e "/sys/class/net/$LINK" ] || { rm -f "$STATE/address"; return 0; }
  if [ "$(id -u)" -eq 0 ]; then
    ip link del "$LINK"
    rm -f "$STATE/address"
  else
    echo "the demo's interface $LINK exists but only root can remove it: sudo ip link del $LINK" >&2
  fi
}

# Prints the node's address: a fresh one on a veth interface as root, else 127.0.0.1.
node_address() {
  if [ -e "/sys/class/net/$LINK" ] && [ -f "$STATE/address" ]; then
    cat "$STATE/address"
    return
  fi
  if [ "$(id -u)" -ne 0 ] || ! command -v ip >/dev/null; then
    echo 127.0.0.1
    return
  fi
  local address
  for address in "${CANDIDATES[@]}"; do
    # Free: only the default route covers it (no local network, VPN or other lab uses it).
    if [ -z "$(ip -4 route show table all to match "$address" | grep -v '^default' || true)" ]; then
      [ ! -e "/sys/class/net/$LINK" ] || ip link del "$LINK" # left behind without its state file
      ip link add "$LINK" type veth peer name "$PEER"
      ip addr add "$address/32" dev "$LINK"
      ip link set "$LINK" up
      ip link set "$PEER" up # without a carrier the address would not be reachable
      echo "$address" >"$STATE/address"
      echo "$address"
      return
    fi
  done
  echo 127.0.0.1
}

if [ "${1:-up}" = down ]; then
  stop_agent
  remove_address
  rm -rf "$STATE/pki"
  "$BIN/vkubelet" dev cluster down --name demo || true
  exit 0
fi

# WORKERS=N (make demo WORKERS=1, root only): real worker nodes beside the virtual one, and a real
# pod next to the virtual ones. Their binaries are built once more (about 8 minutes cold).
WORKERS=${WORKERS:-0}
"$BIN/vkubelet" dev cluster up --name demo --workers "$WORKERS"
KUBECONFIG=$("$BIN/python" -c 'from vkubelet.devcluster import Cluster; print(Cluster("demo").kubeconfig)')
export KUBECONFIG
ADDRESS=$(node_address)

if [ -f "$STATE/agent.pid" ] && kill -0 "$(cat "$STATE/agent.pid")" 2>/dev/null; then
  echo "vkubelet agent already running (pid $(cat "$STATE/agent.pid"))"
else
  # --approve-own-csrs: on this dev cluster nobody else approves the kubelet serving certificate
  # that `kubectl logs/exec` and metrics-server verify. A fresh --cert-dir: a certificate kept
  # from an earlier demo was signed by that cluster's CA, which this cluster does not trust.
  rm -rf "$STATE/pki"
  nohup "$BIN/vkubelet" run --provider mock --provider-config examples/mock.json \
    --nodename "$NODE" --internal-ip "$ADDRESS" --approve-own-csrs \
    --cert-dir "$STATE/pki" >"$STATE/agent.log" 2>&1 &
  echo $! >"$STATE/agent.pid"
  echo "vkubelet agent started (pid $!, node address $ADDRESS, log $STATE/agent.log)"
fi

for _ in $(seq 1 60); do "$BIN/kubectl" get node "$NODE" >/dev/null 2>&1 && break; sleep 1; done
"$BIN/kubectl" wait --for=condition=Ready "node/$NODE" --timeout=60s
"$BIN/kubectl" apply -f examples/deployment.yaml
"$BIN/kubectl" rollout status deployment/hello-virtual --timeout=60s
REAL_LINES=""
if [ "$WORKERS" -gt 0 ]; then
  BUSYBOX=$("$BIN/python" -c 'from vkubelet.devcluster import Cluster; print(Cluster("demo").image_reference("busybox"))')
  sed "s|IMAGE|$BUSYBOX|" examples/real-deployment.yaml | "$BIN/kubectl" apply -f -
  "$BIN/kubectl" rollout status deployment/hello-real --timeout=120s
  REAL=$("$BIN/kubectl" get pods -l app=hello-real -o jsonpath='{.items[0].metadata.name}')
  REAL_LINES="
  kubectl logs $REAL                                   # a real container on a real kubelet
  kubectl exec $REAL -- wget -q -O- http://hello-real  # a Service, through kube-proxy and DNS"
fi
echo "Waiting for the first metrics (metrics-server scrapes the node every 15 s) ..."
for _ in $(seq 1 60); do
  "$BIN/kubectl" top node "$NODE" >/dev/null 2>&1 && break
  sleep 2
done
POD=$("$BIN/kubectl" get pods -l app=hello-virtual -o jsonpath='{.items[0].metadata.name}')

PROXY_LINE="
  kubectl get --raw /api/v1/nodes/$NODE/proxy/stats/summary"
NOTE=""
if [ "$ADDRESS" = 127.0.0.1 ]; then
  PROXY_LINE=""
  NOTE="
Not available: node-proxy paths (kubectl get --raw /api/v1/nodes/$NODE/proxy/...). The apiserver
refuses to proxy them to a loopback address, and giving the node another address (on a veth
interface this script creates) needs root, iproute2 and a free address (see CANDIDATES in
examples/demo.sh). Everything else above works."
fi

cat <<MSG

vkubelet demo is running: a local cluster, the virtual node $NODE (mock provider, address
$ADDRESS) and a Deployment.
Try:
  export KUBECONFIG=$KUBECONFIG PATH=$PWD/$BIN:\$PATH
  kubectl get nodes -o wide
  kubectl get pods -o wide
  kubectl logs $POD
  kubectl exec $POD -- env
  kubectl top node
  kubectl top pod$PROXY_LINE$REAL_LINES
  kubectl describe node $NODE
  kubectl scale deployment hello-virtual --replicas=10
  tail -f $STATE/agent.log
Stop everything: make demo-down$NOTE
MSG
