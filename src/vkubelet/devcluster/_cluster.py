"""A real, local Kubernetes control plane: etcd, kube-apiserver, kube-scheduler, controller-manager
and metrics-server (so that `kubectl top` works).

Everything listens on 127.0.0.1 on free ports and speaks TLS with certificates from a per-cluster
CA, so that the Node authorizer, NodeRestriction, the CSR signer, the apiserver's calls to
kubelets and the aggregation layer behave as in a production cluster. Each cluster lives in its
own directory (PKI, etcd data, logs, kubeconfigs, `cluster.json`), so several can run side by side.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import os
import re
import secrets
import shutil
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization

from .._files import write_atomic, write_kubeconfig, write_private
from . import _network, _objects, _pki, _proc, _workers
from ._build import (
    COREDNS,
    Binaries,
    Progress,
    _locked,
    cache_root,
    ensure_binaries,
    ensure_worker_binaries,
    worker_binaries,
)
from ._errors import DevClusterError
from ._network import NetworkPlan

COMPONENTS = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "metrics-server",
)
#: A cluster with workers also runs the cluster DNS on the host.
NETWORK_COMPONENTS = (*COMPONENTS, "coredns")
SERVICE_CIDR = _network.SERVICE_CIDR  # ClusterIPs exist only in the workers' kube-proxy rules
SERVICE_IP = "10.96.0.1"  # the `kubernetes` Service, a SAN of the apiserver certificate
# Components serving with a certificate from the cluster CA (the others' are self-signed).
_VERIFIED = ("etcd", "kube-apiserver", "metrics-server")
#: Seconds a worker has for containerd to answer and for its node to become Ready.
WORKER_TIMEOUT = 240.0
_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?$")


class ClusterExists(DevClusterError):
    pass


class ClusterNotFound(DevClusterError):
    pass


class PortInUse(DevClusterError):
    pass


class StartupFailed(DevClusterError):
    pass


def state_root() -> Path:
    env = os.environ.get("VKUBELET_STATE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_STATE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".local" / "state") / "vkubelet"


def validate_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise DevClusterError(
            f"invalid cluster name {name!r}: use 1-40 lower-case letters, digits and '-', "
            "starting and ending with a letter or digit"
        )
    return name


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Ports:
    apiserver: int
    etcd_client: int
    etcd_peer: int
    scheduler: int
    controller_manager: int
    metrics_server: int = 0  # 0: a cluster started before metrics-server was part of it
    dns_health: int = 0  # CoreDNS's /health and /ready, on 127.0.0.1 (clusters with workers)
    dns_ready: int = 0

    @classmethod
    def pick(cls, apiserver: int | None) -> Ports:
        if apiserver is not None and not _port_free(apiserver):
            raise PortInUse(
                f"--apiserver-port {apiserver}: 127.0.0.1:{apiserver} is already in use; "
                "choose another port or leave it out to get a free one"
            )
        chosen: set[int] = set() if apiserver is None else {apiserver}

        def fresh() -> int:
            while (port := _free_port()) in chosen:
                pass
            chosen.add(port)
            return port

        return cls(
            apiserver or fresh(), fresh(), fresh(), fresh(), fresh(), fresh(), fresh(), fresh()
        )


@dataclass
class Cluster:
    """A named local cluster: its directory, ports and processes.

    `up()` starts it and returns when it can schedule pods; `down()` stops every process and
    removes the directory. The same object backs the CLI and the pytest fixture.
    """

    name: str
    root: Path = field(default_factory=state_root)

    def __post_init__(self) -> None:
        validate_name(self.name)

    # -- paths ---------------------------------------------------------------------------------
    @property
    def directory(self) -> Path:
        return self.root / "clusters" / self.name

    @property
    def kubeconfig(self) -> Path:
        """Admin kubeconfig (system:masters)."""
        return self.directory / "kubeconfig"

    @property
    def pki(self) -> Path:
        return self.directory / "pki"

    @property
    def _state_file(self) -> Path:
        return self.directory / "cluster.json"

    def log_path(self, component: str) -> Path:
        return self.directory / "logs" / f"{component}.log"

    # -- state -----------------------------------------------------------------------------------
    def state(self) -> dict[str, Any] | None:
        try:
            data: dict[str, Any] = json.loads(self._state_file.read_text())
        except FileNotFoundError:
            return None
        return data

    def _write_state(self, state: dict[str, Any]) -> None:
        write_atomic(self._state_file, json.dumps(state, indent=2))

    def exists(self) -> bool:
        return self._state_file.exists()

    def running_components(self) -> dict[str, bool]:
        state = self.state() or {}
        return {name: _proc.alive(ref) for name, ref in state.get("components", {}).items()}

    def is_up(self) -> bool:
        running = self.running_components()
        return bool(running) and any(running.values())

    @property
    def server(self) -> str:
        return str(self._require_state()["server"])

    @property
    def kubernetes_version(self) -> str:
        return str((self.state() or {}).get("kubernetesVersion", "unknown"))

    def _lock(self) -> contextlib.AbstractContextManager[None]:
        """One `up`/`down` per name at a time, across processes."""
        return _locked(self.root / "clusters" / f".{self.name}.lock")

    # -- up ----------------------------------------------------------------------------------------
    def up(
        self,
        *,
        apiserver_port: int | None = None,
        workers: int = 0,
        progress: Progress = print,
        tie_to_parent: bool = False,
        extra_args: dict[str, list[str]] | None = None,
        binaries: Binaries | None = None,
        timeout: float = 120.0,
    ) -> None:
        """Start the cluster; on any failure stop what was started and leave nothing behind.

        `workers` adds that many real worker nodes (kubelet, containerd, kube-proxy) on a pod
        network of this machine, with CoreDNS; an `up` of a cluster that is already up reuses
        it (adding workers it lacks, restarting worker components that died).
        `tie_to_parent` makes the kernel kill the components when this process dies (for tests).
        `extra_args` appends flags per component, e.g. a shorter node-monitor grace period.
        """
        extra_args = extra_args or {}
        unknown = set(extra_args) - set(NETWORK_COMPONENTS)
        if unknown:
            raise DevClusterError(f"extra_args: unknown component(s) {sorted(unknown)}")
        if not 0 <= workers <= _network.MAX_WORKERS:
            raise DevClusterError(f"--workers: 0 to {_network.MAX_WORKERS}, not {workers}")
        with self._lock():
            if self.exists() and self.is_up():
                self._reuse(apiserver_port, workers, progress, tie_to_parent)
                return
            if workers:  # before a possibly long build: what this machine lacks for workers
                _network.preflight()
                _workers.check_paths(self.root, cache_root())
            Ports.pick(apiserver_port)  # fail fast, before a possibly long build
            bins = binaries or ensure_binaries(progress)
            node_bins = ensure_worker_binaries(progress) if workers else {}
            images = self._worker_images(progress) if workers else []
            if self.exists():
                progress(f"Removing stale state of cluster {self.name!r} (no process running)")
                self._teardown()
            ports = Ports.pick(apiserver_port)
            progress(f"Starting cluster {self.name!r} (Kubernetes {bins.kubernetes_version})")
            try:
                plan = self._allocate_network() if workers else None
                self._prepare(ports, bins, plan)
                self._start_all(ports, bins, extra_args, tie_to_parent, progress, timeout)
                if workers:
                    self._add_images(images)
                    self._start_workers(workers, node_bins, tie_to_parent, progress)
            except BaseException:
                self._teardown()
                raise

    def _reuse(
        self,
        apiserver_port: int | None,
        workers: int,
        progress: Progress,
        tie_to_parent: bool,
    ) -> None:
        state = self._require_state()
        if apiserver_port is not None and apiserver_port != state["ports"]["apiserver"]:
            raise ClusterExists(
                f"cluster {self.name!r} is already up on another port ({self.server}); "
                f"stop it first with `vkubelet dev cluster down --name {self.name}`"
            )
        if workers and not state.get("network"):
            raise ClusterExists(
                f"cluster {self.name!r} is up without a pod network, and worker nodes need one "
                "from the start (the apiserver must listen where pods reach it): stop it with "
                f"`vkubelet dev cluster down --name {self.name}` and start it again with "
                "--workers, or use another --name"
            )
        progress(f"Cluster {self.name!r} is already up ({self.server}); reusing it")
        if workers:
            _network.preflight()
            node_bins = ensure_worker_binaries(progress)
            self._add_images(self._worker_images(progress))
            self._start_workers(workers, node_bins, tie_to_parent, progress)

    def _worker_images(self, progress: Progress) -> list[dict[str, str]]:
        """What every worker has before its first pod: the pause and busybox images."""
        from ._images import build_image

        built = [build_image(kind, progress) for kind in ("pause", "busybox")]
        return [{"reference": i.reference, "path": str(i.path)} for i in built]

    def image_reference(self, stem: str) -> str:
        """The full name of a loaded image whose name ends in `/<stem>` (e.g. busybox)."""
        for image in (self.state() or {}).get("images", []):
            if image["reference"].rsplit(":", 1)[0].endswith(f"/{stem}"):
                return str(image["reference"])
        raise DevClusterError(f"no image named like {stem!r} is loaded in cluster {self.name!r}")

    def load_image(self, archive: Path) -> list[str]:
        """Import an image archive into every worker's containerd (and into later workers)."""
        if not archive.is_file():
            raise DevClusterError(f"{archive}: no such image archive")
        with self._lock():
            state = self._require_state()
            workers = self.workers()
            if not workers:
                raise DevClusterError(
                    f"cluster {self.name!r} has no worker nodes to load images into (start it "
                    "with `vkubelet dev cluster up --workers N`)"
                )
            binaries = worker_binaries()
            for worker in workers:
                _workers.import_image(worker, binaries, archive)
            images = state.setdefault("images", [])
            if str(archive.resolve()) not in [i["path"] for i in images]:
                images.append({"reference": "", "path": str(archive.resolve())})
                self._write_state(state)
        return [w.name for w in workers]

    def _allocate_network(self) -> NetworkPlan:
        plan = _network.allocate(self.directory, _owner_is_gone, _reclaim_network)
        _network.ensure_bridge(plan)
        return plan

    def _prepare(self, ports: Ports, bins: Binaries, plan: NetworkPlan | None) -> None:
        for sub in ("pki", "logs", "etcd"):
            (self.directory / sub).mkdir(parents=True, exist_ok=True)
        self.directory.chmod(0o700)
        # With workers, the apiserver listens on the host bridge, where pods and kubelets in
        # their namespaces reach it (and it backs the `kubernetes` Service); else on loopback.
        host = plan.host_ip if plan else "127.0.0.1"
        self._write_pki(host)
        server = f"https://{host}:{ports.apiserver}"
        self._write_kubeconfigs(server, dns=plan is not None)
        if plan:
            (self.directory / "Corefile").write_text(_corefile(self.directory, host, ports))
        self._write_state(
            {
                "name": self.name,
                "server": server,
                "host": host,
                "network": {"index": plan.index} if plan else None,
                "workers": {},
                "kubernetesVersion": bins.kubernetes_version,
                "binaries": str(bins.directory),
                "ports": ports.__dict__,
                "created": time.time(),
                "components": {},
                "argv": {},
            }
        )

    def _write_pki(self, host: str) -> None:
        pki = self.pki
        ca = _pki.new_ca(f"vkubelet-dev-{self.name}-ca")
        ca.write(pki, "ca")
        _pki.issue(
            ca,
            "kube-apiserver",
            server=True,
            dns_names=(
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ),
            ip_addresses=tuple(dict.fromkeys(("127.0.0.1", host, SERVICE_IP))),
        ).write(pki, "apiserver")
        _pki.issue(
            ca,
            "etcd",
            server=True,
            client=True,
            dns_names=("localhost",),
            ip_addresses=("127.0.0.1",),
        ).write(pki, "etcd")
        # The aggregation layer (metrics-server behind `kubectl top`) authenticates the
        # apiserver's proxied requests with a separate CA, as in kubeadm clusters.
        front_proxy_ca = _pki.new_ca(f"vkubelet-dev-{self.name}-front-proxy-ca")
        front_proxy_ca.write(pki, "front-proxy-ca")
        _pki.issue(front_proxy_ca, "front-proxy-client", client=True).write(
            pki, "front-proxy-client"
        )
        sa_key = _pki.new_key()
        write_private(pki / "sa.key", _pki.private_pem(sa_key))
        (pki / "sa.pub").write_bytes(
            sa_key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
        for stem, cn, orgs in (
            ("admin", "kubernetes-admin", ("system:masters",)),
            ("apiserver-etcd-client", "kube-apiserver-etcd-client", ()),
            # How the apiserver proves itself to kubelets (and so to vkubelet's kubelet port).
            ("apiserver-kubelet-client", "kube-apiserver-kubelet-client", ()),
            ("controller-manager", "system:kube-controller-manager", ()),
            ("scheduler", "system:kube-scheduler", ()),
            # For the apiserver and for kubelets, which authorize it on nodes/metrics.
            ("metrics-server", _objects.METRICS_SERVER_USER, ()),
            ("coredns", _objects.COREDNS_USER, ()),
        ):
            _pki.issue(ca, cn, organizations=orgs, client=True).write(pki, stem)
        # The aggregator checks this certificate for the Service's name, whatever it dials.
        _pki.issue(
            ca,
            "metrics-server",
            server=True,
            dns_names=(f"{_objects.METRICS_SERVER_SERVICE}.kube-system.svc", "localhost"),
            ip_addresses=("127.0.0.1",),
        ).write(pki, "metrics-server-serving")

    def _write_kubeconfigs(self, server: str, *, dns: bool) -> None:
        ca = (self.pki / "ca.crt").read_bytes()
        for stem, path in (
            ("admin", self.kubeconfig),
            ("controller-manager", self.directory / "controller-manager.kubeconfig"),
            ("scheduler", self.directory / "scheduler.kubeconfig"),
            ("metrics-server", self.directory / "metrics-server.kubeconfig"),
            *((("coredns", self.directory / "coredns.kubeconfig"),) if dns else ()),
        ):
            write_kubeconfig(
                path,
                cluster=f"vkubelet-{self.name}",
                server=server,
                ca_pem=ca,
                user=stem,
                cert_pem=(self.pki / f"{stem}.crt").read_bytes(),
                key_pem=(self.pki / f"{stem}.key").read_bytes(),
            )

    def _argv(self, component: str, ports: Ports, bins: Binaries) -> list[str]:
        pki = self.pki
        d = self.directory
        binary = str(
            COREDNS.cache_dir() / "coredns" if component == "coredns" else bins.paths[component]
        )
        if component == "etcd":
            client = f"https://127.0.0.1:{ports.etcd_client}"
            peer = f"http://127.0.0.1:{ports.etcd_peer}"
            return [
                binary,
                "--name=default",
                f"--data-dir={d / 'etcd'}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=default={peer}",
                f"--cert-file={pki / 'etcd.crt'}",
                f"--key-file={pki / 'etcd.key'}",
                f"--trusted-ca-file={pki / 'ca.crt'}",
                "--client-cert-auth=true",
                # A throw-away dev cluster: fsync per write would make etcd, not the code under
                # test, the bottleneck of every benchmark on a slow disk.
                "--unsafe-no-fsync=true",
                "--log-level=warn",
            ]
        if component == "kube-apiserver":
            host = self._host()
            return [
                binary,
                f"--bind-address={host}",
                f"--advertise-address={host}",
                # Loopback cannot back the `kubernetes` Service endpoints: without workers
                # nothing dials them (pods run elsewhere, through providers); with workers the
                # host bridge address does, and pods reach the API through the Service.
                "--endpoint-reconciler-type=" + ("none" if host == "127.0.0.1" else "lease"),
                f"--secure-port={ports.apiserver}",
                f"--etcd-servers=https://127.0.0.1:{ports.etcd_client}",
                f"--etcd-cafile={pki / 'ca.crt'}",
                f"--etcd-certfile={pki / 'apiserver-etcd-client.crt'}",
                f"--etcd-keyfile={pki / 'apiserver-etcd-client.key'}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
                f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
                f"--kubelet-certificate-authority={pki / 'ca.crt'}",
                "--kubelet-preferred-address-types=InternalIP,Hostname,ExternalIP",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                f"--requestheader-client-ca-file={pki / 'front-proxy-ca.crt'}",
                "--requestheader-allowed-names=front-proxy-client",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--proxy-client-cert-file={pki / 'front-proxy-client.crt'}",
                f"--proxy-client-key-file={pki / 'front-proxy-client.key'}",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                "--enable-bootstrap-token-auth=true",
                "--allow-privileged=true",
                "--profiling=false",
                "--v=1",
            ]
        if component == "coredns":
            return [binary, "-conf", str(d / "Corefile")]
        if component == "metrics-server":
            return [
                binary,
                *_kubeconfig_flags(d / "metrics-server.kubeconfig"),
                "--bind-address=127.0.0.1",
                f"--secure-port={ports.metrics_server}",
                f"--tls-cert-file={pki / 'metrics-server-serving.crt'}",
                f"--tls-private-key-file={pki / 'metrics-server-serving.key'}",
                # Kubelets are scraped directly, at the node's address and kubelet port, with
                # their serving certificates verified against the cluster CA (which signs the
                # CSRs for kubernetes.io/kubelet-serving).
                "--kubelet-preferred-address-types=InternalIP,ExternalIP,Hostname",
                "--kubelet-use-node-status-port",
                f"--kubelet-certificate-authority={pki / 'ca.crt'}",
                f"--kubelet-client-certificate={pki / 'metrics-server.crt'}",
                f"--kubelet-client-key={pki / 'metrics-server.key'}",
                # Usage is a rate over two scrapes: the shortest resolution metrics-server
                # accepts (10 s) lets `kubectl top` answer ~20 s after a node starts, and
                # follow a change of load as fast, instead of two minutes. It must exceed the
                # kubelet request timeout by 10 %: a scrape of a dev node takes milliseconds.
                "--metric-resolution=10s",
                "--kubelet-request-timeout=5s",
                "--v=1",
            ]
        common = [
            "--bind-address=127.0.0.1",
            "--leader-elect=false",
            "--profiling=false",
            "--v=1",
        ]
        if component == "kube-scheduler":
            return [
                binary,
                *_kubeconfig_flags(d / "scheduler.kubeconfig"),
                f"--secure-port={ports.scheduler}",
                *common,
            ]
        if component == "kube-controller-manager":
            return [
                binary,
                *_kubeconfig_flags(d / "controller-manager.kubeconfig"),
                f"--secure-port={ports.controller_manager}",
                # The CSR signer: kubelet client and serving certificates are signed by the
                # cluster CA, which the apiserver trusts for clients and for kubelets.
                f"--cluster-signing-cert-file={pki / 'ca.crt'}",
                f"--cluster-signing-key-file={pki / 'ca.key'}",
                f"--root-ca-file={pki / 'ca.crt'}",
                f"--service-account-private-key-file={pki / 'sa.key'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--use-service-account-credentials=true",
                "--controllers=*,bootstrapsigner,tokencleaner",
                # Its default client rate limit (20 requests/s) spends ~5 s of every `up` on
                # discovery before the controllers start (the default ServiceAccount waits for
                # them); a local apiserver has no one else to protect.
                "--kube-api-qps=500",
                "--kube-api-burst=1000",
                *common,
            ]
        raise DevClusterError(f"unknown component {component!r}")

    def _start_all(
        self,
        ports: Ports,
        bins: Binaries,
        extra_args: dict[str, list[str]],
        tie_to_parent: bool,
        progress: Progress,
        timeout: float,
    ) -> None:
        started = time.monotonic()
        state = self.state() or {}
        network = self._network_plan() is not None
        for component in NETWORK_COMPONENTS if network else COMPONENTS:
            argv = self._argv(component, ports, bins) + extra_args.get(component, [])
            state["argv"][component] = argv
            ref = _proc.start(
                argv, self.log_path(component), cwd=self.directory, tie_to_parent=tie_to_parent
            )
            state["components"][component] = ref.to_json()
            self._write_state(state)
            self._wait_healthy(component, ports, timeout)
            if component == "kube-apiserver":
                self._create(
                    _objects.kubelet_access()
                    + _objects.metrics_server_access()
                    + _objects.dev_cluster_marker(self.name)
                    + (
                        _objects.cluster_dns(_network.DNS_SERVICE_IP, self._host())
                        if network
                        else []
                    ),
                    timeout,
                )
            if component == "metrics-server":
                self._register_metrics_api(ports, timeout)
        self._wait(
            "the controller-manager to create the default ServiceAccount",
            lambda: (
                self.request("GET", "/api/v1/namespaces/default/serviceaccounts/default")[0] == 200
            ),
            timeout,
            "kube-controller-manager",
        )
        progress(f"Cluster {self.name!r} is up in {time.monotonic() - started:.1f}s: {self.server}")

    def _create(self, items: list[_objects.Item], timeout: float) -> None:
        """POST each object, keeping any that exists (a restarted `up` or a user's own).

        A 404 is retried: the apiserver creates kube-public and kube-system just after it
        becomes ready.
        """
        for path, obj in items:
            what = f"{obj['kind']} {obj['metadata']['name']}"

            def created(path: str = path, obj: dict[str, Any] = obj, what: str = what) -> bool:
                status, body = self.request("POST", path, obj)
                if status == 404:
                    return False
                if status not in (201, 409):
                    raise StartupFailed(f"could not create {what}: {body}")
                return True

            self._wait(f"the apiserver to accept {what}", created, timeout, "kube-apiserver")

    def _register_metrics_api(self, ports: Ports, timeout: float) -> None:
        """Register metrics-server with the aggregator; wait until the apiserver reaches it."""
        self._create(
            _objects.metrics_api(ports.metrics_server, (self.pki / "ca.crt").read_bytes()),
            timeout,
        )

        self._wait(
            "the metrics.k8s.io APIService to become available",
            functools.partial(
                self._has_condition,
                "/apis/apiregistration.k8s.io/v1/apiservices/v1beta1.metrics.k8s.io",
                "Available",
            ),
            timeout,
            "metrics-server",
        )

    def _has_condition(self, path: str, condition: str) -> bool:
        """Whether the object at `path` (a node, an APIService) has `condition` True."""
        status, body = self.request("GET", path)
        conditions = body.get("status", {}).get("conditions", []) if status == 200 else []
        return any(c["type"] == condition and c["status"] == "True" for c in conditions)

    def bootstrap_kubeconfig(self, path: Path, *, ttl_hours: int = 24) -> Path:
        """A kubeconfig with a fresh bootstrap token, for an agent's `--bootstrap-kubeconfig`."""
        token_id = secrets.token_hex(3)
        token_secret = secrets.token_hex(8)
        expiry = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + ttl_hours * 3600))
        secret = {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "bootstrap.kubernetes.io/token",
            "metadata": {"name": f"bootstrap-token-{token_id}", "namespace": "kube-system"},
            "stringData": {
                "token-id": token_id,
                "token-secret": token_secret,
                "expiration": expiry,
                "usage-bootstrap-authentication": "true",
                "usage-bootstrap-signing": "true",
            },
        }
        status, body = self.request("POST", "/api/v1/namespaces/kube-system/secrets", secret)
        if status != 201:
            raise DevClusterError(f"could not create a bootstrap token: {body}")
        write_kubeconfig(
            path,
            cluster=f"vkubelet-{self.name}",
            server=self.server,
            ca_pem=(self.pki / "ca.crt").read_bytes(),
            user=f"bootstrap-{token_id}",
            token=f"{token_id}.{token_secret}",
        )
        return path

    def _healthy(self, component: str, ports: Ports) -> bool:
        host, port, path = {
            "etcd": ("127.0.0.1", ports.etcd_client, "/health"),
            "kube-apiserver": (self._host(), ports.apiserver, "/readyz"),
            # Ready once its kubernetes plugin has synced with the API.
            "coredns": ("127.0.0.1", ports.dns_ready, "/ready"),
            "kube-scheduler": ("127.0.0.1", ports.scheduler, "/healthz"),
            "kube-controller-manager": ("127.0.0.1", ports.controller_manager, "/healthz"),
            # /readyz waits for the first scrapes of kubelets; /livez means it serves.
            "metrics-server": ("127.0.0.1", ports.metrics_server, "/livez"),
        }[component]
        try:
            # The scheduler and controller-manager serve with self-signed certificates.
            ctx = None if component == "coredns" else self._ssl_context(component in _VERIFIED)
            return _network.request(host, port, "GET", path, ctx=ctx, timeout=3)[0] == 200
        except (OSError, http.client.HTTPException):
            return False

    def _wait_healthy(self, component: str, ports: Ports, timeout: float) -> None:
        self._wait(
            f"{component} to become healthy",
            lambda: self._healthy(component, ports),
            timeout,
            component,
        )

    def _wait(self, what: str, check: Callable[[], bool], timeout: float, component: str) -> None:
        def died() -> tuple[str, Path] | None:
            ref = (self.state() or {}).get("components", {}).get(component)
            if ref and not _proc.alive(ref):
                return component, self.log_path(component)
            return None

        _wait_until(what, check, timeout, died=died, log=self.log_path(component))

    def _ssl_context(self, verify: bool = True) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        if not verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        ctx.load_cert_chain(self.pki / "admin.crt", self.pki / "admin.key")
        return ctx

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """A minimal admin call to the apiserver, for readiness checks without extra clients."""
        state = self._require_state()
        status, raw = _network.request(
            state.get("host", "127.0.0.1"),
            state["ports"]["apiserver"],
            method,
            path,
            ctx=self._ssl_context(),
            body=None if body is None else json.dumps(body),
            timeout=5,
        )
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode(errors="replace")

    # -- components, for tests that break and heal the control plane ------------------------------
    def stop_component(self, component: str) -> None:
        state = self._require_state()
        ref = state["components"].get(component)
        if ref:
            _proc.stop(_proc.ProcessRef.from_json(ref))

    def start_component(self, component: str, *, tie_to_parent: bool = False) -> None:
        state = self._require_state()
        if _proc.alive(state["components"].get(component)):
            return
        argv = state["argv"][component]
        new = _proc.start(
            argv, self.log_path(component), cwd=self.directory, tie_to_parent=tie_to_parent
        )
        state["components"][component] = new.to_json()
        self._write_state(state)
        ports = Ports(**state["ports"])
        self._wait_healthy(component, ports, 120)

    def restart_component(self, component: str, *, tie_to_parent: bool = False) -> float:
        """Stop `component` and start it again (healthy); the seconds it was away."""
        started = time.monotonic()
        self.stop_component(component)
        self.start_component(component, tie_to_parent=tie_to_parent)
        return time.monotonic() - started

    def compact_etcd(self) -> int:
        """Compact etcd's history up to its current revision; return that revision.

        What a long-running cluster's apiserver does every five minutes: watches that resume
        from an older resourceVersion (after an apiserver restart, whose watch cache starts
        afresh) then get 410 Gone, and expired list continuations too. Through etcd's
        JSON gateway on the client port, with the apiserver's etcd client certificate: no
        etcdctl to build.
        """
        revision = int(self._etcd("/v3/kv/range", {"key": "AA=="})["header"]["revision"])
        try:
            self._etcd("/v3/kv/compaction", {"revision": str(revision), "physical": True})
        except DevClusterError as e:
            if "has been compacted" not in str(e):  # already compacted there: nothing to do
                raise
        return revision

    def _etcd(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        ctx.load_cert_chain(
            self.pki / "apiserver-etcd-client.crt", self.pki / "apiserver-etcd-client.key"
        )
        port = self._require_state()["ports"]["etcd_client"]
        status, raw = _network.request(
            "127.0.0.1", port, "POST", path, ctx=ctx, body=json.dumps(body), timeout=30
        )
        if status != 200:
            raise DevClusterError(f"etcd {path}: {status} {raw[:200]!r}")
        answer: dict[str, Any] = json.loads(raw)
        return answer

    def _require_state(self) -> dict[str, Any]:
        state = self.state()
        if state is None:
            raise ClusterNotFound(self._not_found_message())
        return state

    # -- status / down ---------------------------------------------------------------------------
    def status(self) -> dict[str, str]:
        """Per component: 'healthy', 'unhealthy' (running but not answering) or 'stopped'."""
        state = self._require_state()
        ports = Ports(**state["ports"])
        result = {}
        for component, alive in self.running_components().items():
            if not alive:
                result[component] = "stopped"
            else:
                result[component] = "healthy" if self._healthy(component, ports) else "unhealthy"
        for worker in self.workers():
            record = state["workers"][worker.name]["components"]
            for component in _workers.COMPONENTS:
                if not _proc.alive(record.get(component)):
                    result[f"{worker.name}/{component}"] = "stopped"
                    continue
                ok = (
                    _workers.containerd_answers(worker, worker_binaries())
                    if component == "containerd"
                    else _workers.healthz(worker, component)
                )
                result[f"{worker.name}/{component}"] = "healthy" if ok else "unhealthy"
        return result

    def down(self) -> None:
        """Stop every process of the cluster and delete its directory."""
        with self._lock():
            if not self.exists():
                raise ClusterNotFound(self._not_found_message())
            self._teardown()

    def _teardown(self) -> None:
        state = self.state() or {}
        plan = self._network_plan()
        # Only a network still registered to us (or to nobody) is ours to clean: if this
        # cluster was dead long enough for another to reclaim its index, that one owns it now.
        owned = plan is not None and _network.registered_owner(plan.index) in (
            None,
            str(self.directory),
        )
        if plan is not None and owned:
            for worker in self.workers():  # the API's clients first
                refs = state["workers"][worker.name]["components"]
                _workers.teardown(
                    worker, {c: _proc.ProcessRef.from_json(ref) for c, ref in refs.items()}
                )
            _workers.reclaim(plan)  # and what a crash left without a record
        # Reverse start order: clients first, etcd last, so nothing logs spurious errors.
        for component in reversed(NETWORK_COMPONENTS):
            ref = state.get("components", {}).get(component)
            if ref:
                _proc.stop(_proc.ProcessRef.from_json(ref))
        if plan is not None and owned:
            _network.remove_leftovers(plan)
            _network.release(plan, self.directory)
        shutil.rmtree(self.directory, ignore_errors=True)

    # -- worker nodes ------------------------------------------------------------------------------
    def _host(self) -> str:
        return str((self.state() or {}).get("host", "127.0.0.1"))

    def _network_plan(self) -> NetworkPlan | None:
        network = (self.state() or {}).get("network")
        return NetworkPlan(int(network["index"])) if network else None

    def virtual_pod_cidr(self) -> str | None:
        """Where this cluster's vm nodes take their pods' addresses (routed from its workers);
        None without a pod network. Give each vm node its own /24 of it as `podCIDR`."""
        plan = self._network_plan()
        return str(plan.virtual_cidr) if plan else None

    def workers(self) -> list[_workers.Worker]:
        """The worker nodes this cluster has started (in their recorded order)."""
        plan = self._network_plan()
        if plan is None:
            return []
        return [
            _workers.Worker(
                name, plan.worker(int(record["index"])), self.directory / "workers" / name
            )
            for name, record in (self.state() or {}).get("workers", {}).items()
        ]

    def _start_workers(
        self,
        count: int,
        binaries: dict[str, Path],
        tie_to_parent: bool,
        progress: Progress,
    ) -> None:
        """Start the workers 0..count-1 that are missing, and worker components that died."""
        plan = self._network_plan()
        assert plan is not None
        state = self._require_state()
        ca = _pki.load(self.pki / "ca.crt", self.pki / "ca.key")
        for i in range(count):
            name = f"{self.name}-worker-{i}"
            if name not in state["workers"]:
                state["workers"][name] = {"index": i, "components": {}}
                self._write_state(state)
        workers = self.workers()
        for worker in workers:
            _network.ensure_worker_link(plan, worker.addresses)
        _network.route_between([w.addresses for w in workers])
        _network.route_virtual_services(plan, workers[0].addresses if workers else None)
        started = time.monotonic()
        for worker in workers:
            record = state["workers"][worker.name]["components"]
            dead = [c for c in _workers.COMPONENTS if not _proc.alive(record.get(c))]
            if not dead:
                continue
            progress(
                f"Starting worker {worker.name} ({', '.join(dead)}) at {worker.addresses.node_ip}"
            )
            if not (worker.directory / "kubelet.yaml").exists():
                _workers.write_files(
                    worker, plan=plan, ca=ca, server=self.server, binaries=binaries
                )
            _workers.ensure_mount_namespace(worker)
            _workers.ensure_cgroups(worker)
            for component in dead:
                ref = _proc.start(
                    _workers.argv(worker, component, binaries),
                    worker.log_path(component),
                    cwd=worker.directory,
                    tie_to_parent=tie_to_parent,
                )
                record[component] = ref.to_json()
                self._write_state(state)
                if component == "containerd":
                    self._wait_worker(
                        worker,
                        component,
                        "containerd to answer",
                        functools.partial(_workers.containerd_answers, worker, binaries),
                    )
                    for image in state.get("images", []):
                        _workers.import_image(worker, binaries, Path(image["path"]))
        for worker in workers:
            self._wait_worker(
                worker,
                "kubelet",
                f"node {worker.name} to become Ready",
                functools.partial(self._has_condition, f"/api/v1/nodes/{worker.name}", "Ready"),
            )
        progress(
            f"{len(workers)} worker node(s) Ready in {time.monotonic() - started:.1f}s: "
            + ", ".join(f"{w.name} ({w.addresses.node_ip})" for w in workers)
        )

    def _add_images(self, images: list[dict[str, str]]) -> None:
        state = self._require_state()
        known = state.setdefault("images", [])
        for image in images:
            known[:] = [i for i in known if i["reference"] != image["reference"]] + [image]
        self._write_state(state)

    def _wait_worker(
        self,
        worker: _workers.Worker,
        component: str,
        what: str,
        check: Callable[[], bool],
    ) -> None:
        def died() -> tuple[str, Path] | None:
            for name, ref in self._require_state()["workers"][worker.name]["components"].items():
                if not _proc.alive(ref):
                    return f"{name} of {worker.name}", worker.log_path(name)
            return None

        _wait_until(what, check, WORKER_TIMEOUT, died=died, log=worker.log_path(component))

    def _not_found_message(self) -> str:
        known = [c.name for c in list_clusters(self.root)]
        listing = ", ".join(known) if known else "none"
        return f"no cluster named {self.name!r} (known clusters: {listing})"


def list_clusters(root: Path | None = None) -> list[Cluster]:
    base = (root or state_root()) / "clusters"
    if not base.is_dir():
        return []
    return [
        Cluster(p.name, root or state_root())
        for p in sorted(base.iterdir())
        if (p / "cluster.json").exists()
    ]


def _wait_until(
    what: str,
    check: Callable[[], bool],
    timeout: float,
    *,
    died: Callable[[], tuple[str, Path] | None],
    log: Path,
) -> None:
    """Poll `check`; fail at once, with its log's tail, if a process it needs died (`died`
    names it and its log), or after `timeout` with the tail of `log`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = died()
        if dead:
            name, path = dead
            raise StartupFailed(
                f"{name} exited while waiting for {what}{_diagnosis(path)}; "
                f"last lines of {path}:\n{_tail(path)}"
            )
        with contextlib.suppress(OSError, http.client.HTTPException):
            if check():
                return
        time.sleep(0.2)
    raise StartupFailed(
        f"timed out after {timeout:.0f}s waiting for {what}; last lines of {log}:\n{_tail(log)}"
    )


_INOTIFY_EXHAUSTED = re.compile(r"(?:fsnotify|inotify)[^\n]*too many open files", re.IGNORECASE)
_INOTIFY_LIMIT = Path("/proc/sys/fs/inotify/max_user_instances")


def _diagnosis(log: Path) -> str:
    """A cause the last lines of a dead component's log hide. Running out of inotify instances
    (a per-user limit, shared by every cluster on the machine: each kubelet, containerd and
    apiserver holds several) shows first as a watcher error, then as an unrelated failure (the
    kubelet: "unknown service runtime.v1.RuntimeService"), so it is named here."""
    try:
        text = log.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    if not _INOTIFY_EXHAUSTED.search(text):
        return ""
    limit = _INOTIFY_LIMIT.read_text().strip() if _INOTIFY_LIMIT.exists() else "?"
    return (
        f" (it ran out of inotify instances: fs.inotify.max_user_instances is {limit}, for all"
        " clusters and processes of this user on the machine; raise it, e.g."
        " `sysctl -w fs.inotify.max_user_instances=512`)"
    )


def _tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def _reclaim_network(plan: NetworkPlan) -> None:
    """Everything a dead cluster left of its network: workers first, then the host bridge."""
    _workers.reclaim(plan)
    _network.remove_leftovers(plan)


def _owner_is_gone(directory: str) -> bool:
    """Whether the cluster in `directory` has no live process (its network may be reclaimed)."""
    try:
        state = json.loads((Path(directory) / "cluster.json").read_text())
    except (OSError, ValueError):
        return True
    refs = [*state.get("components", {}).values()]
    for record in state.get("workers", {}).values():
        refs += record.get("components", {}).values()
    return not any(_proc.alive(ref) for ref in refs)


def _kubeconfig_flags(kubeconfig: Path) -> list[str]:
    """One identity for a component's own calls and for the authentication and authorization
    of its callers (which it delegates to the apiserver)."""
    return [f"--{use}kubeconfig={kubeconfig}" for use in ("", "authentication-", "authorization-")]


def _corefile(directory: Path, host: str, ports: Ports) -> str:
    """CoreDNS on the host bridge: cluster.local from the API, nothing forwarded elsewhere."""
    return f"""\
.:53 {{
    bind {host}
    errors
    health 127.0.0.1:{ports.dns_health}
    ready 127.0.0.1:{ports.dns_ready}
    kubernetes {_network.CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {directory / "coredns.kubeconfig"}
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 30
    }}
    cache 30
    loadbalance
}}
"""
