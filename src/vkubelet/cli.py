"""The `vkubelet` command line."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import subprocess
import sys
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from . import __version__
from ._logging import LogFormat, setup_logging

if TYPE_CHECKING:
    from rich.console import Console

    from .agent import ReplicaOptions
    from .kube import KubeClient

# `vkubelet run` imports neither the dev cluster's code nor rich (each restart of an agent pays
# for what it imports): the commands that need them import them.

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="vkubelet: make anything look like a Kubernetes node.",
)
dev = typer.Typer(no_args_is_help=True, help="Local development tools.")
cluster_app = typer.Typer(
    no_args_is_help=True,
    help="A real local control plane (etcd, kube-apiserver, scheduler, controller-manager).",
)
vm_app = typer.Typer(no_args_is_help=True, help="VirtualMachine resources (docs/vm-resource.md).")
app.add_typer(dev, name="dev")
app.add_typer(vm_app, name="vm")
host_app = typer.Typer(
    no_args_is_help=True, help="The agent as a systemd service of this host (docs/host-install.md)."
)
app.add_typer(host_app, name="host")
dev.add_typer(cluster_app, name="cluster")
image_app = typer.Typer(
    no_args_is_help=True,
    help="Container images for dev clusters' worker nodes, built locally (no registry).",
)
dev.add_typer(image_app, name="image")


class _Console:
    """A rich Console made at its first use. Piped output is not wrapped at 80 columns: users
    copy these commands and paths."""

    def __init__(self, *, stderr: bool) -> None:
        self._stderr = stderr
        self._console: Console | None = None

    def print(self, *objects: Any, **options: Any) -> None:
        if self._console is None:
            from rich.console import Console

            stream = sys.stderr if self._stderr else sys.stdout
            width = None if stream.isatty() else 250
            self._console = Console(stderr=self._stderr, soft_wrap=True, width=width)
        self._console.print(*objects, **options)


out = _Console(stderr=False)
err = _Console(stderr=True)

NameOption = Annotated[
    str, typer.Option("--name", "-n", help="Cluster name; several can run side by side.")
]
KubeconfigOption = Annotated[
    Path | None,
    typer.Option(envvar="KUBECONFIG", help="Default: ~/.kube/config or in-cluster."),
]


def _fail(error: Exception) -> typer.Exit:
    err.print(f"[bold red]error:[/] {error}", highlight=False, markup=True, soft_wrap=True)
    return typer.Exit(1)


@contextlib.contextmanager
def _failing(*errors: type[Exception]) -> Iterator[None]:
    """Errors a user can act on: their message, exit status 1, no traceback."""
    try:
        yield
    except errors as e:
        raise _fail(e) from None


def _progress(message: str) -> None:
    err.print(message, highlight=False, markup=False)


@app.command()
def version() -> None:
    """Print vkubelet's version."""
    out.print(__version__)


@app.command()
def run(
    provider: Annotated[
        str | None,
        typer.Option(
            envvar="VKUBELET_PROVIDER",
            help="An installed provider's name (see `providers`), module:factory, or a path to "
            "a .py file (factory `create`, or path.py:factory).",
        ),
    ] = None,
    provider_config: Annotated[
        Path | None, typer.Option(envvar="VKUBELET_PROVIDER_CONFIG", help="Provider config file.")
    ] = None,
    nodename: Annotated[
        str, typer.Option(envvar="VKUBELET_NODENAME", help="Name of the virtual node.")
    ] = "vkubelet",
    kubeconfig: KubeconfigOption = None,
    config: Annotated[
        Path | None,
        typer.Option(envvar="VKUBELET_CONFIG", help="Agent config (YAML) listing several nodes."),
    ] = None,
    kubelet_port: Annotated[int, typer.Option(envvar="KUBELET_PORT", min=0, max=65535)] = 10250,
    internal_ip: Annotated[
        str, typer.Option(envvar="VKUBELET_POD_IP", help="The node's InternalIP address.")
    ] = "127.0.0.1",
    label: Annotated[list[str], typer.Option(help="Extra node label key=value (repeatable).")] = [],  # noqa: B006
    taint: Annotated[
        list[str], typer.Option(help="Replace the default taint: key=value:Effect (repeatable).")
    ] = [],  # noqa: B006
    disable_taint: Annotated[bool, typer.Option(help="Register the node without taints.")] = False,
    kube_api_qps: Annotated[float | None, typer.Option(help="Client-side request limit.")] = None,
    kube_api_burst: Annotated[int, typer.Option()] = 1000,
    pod_sync_workers: Annotated[int, typer.Option(min=1)] = 96,
    tls_cert_file: Annotated[
        Path | None, typer.Option(help="Kubelet serving certificate (default: from a CSR).")
    ] = None,
    tls_private_key_file: Annotated[Path | None, typer.Option()] = None,
    client_ca_file: Annotated[
        Path | None, typer.Option(help="CA of the apiserver's kubelet client certificate.")
    ] = None,
    cert_dir: Annotated[
        Path | None,
        typer.Option(
            help="Where CSR-issued certificates are kept, in a subdirectory per cluster CA "
            "[default: ~/.local/state/vkubelet/pki]."
        ),
    ] = None,
    approve_own_csrs: Annotated[
        bool | None,
        typer.Option(
            "--approve-own-csrs/--no-approve-own-csrs",
            help="Approve our serving CSRs ourselves. Default: only on a vkubelet dev cluster "
            "(ConfigMap kube-public/vkubelet-dev-cluster); elsewhere a cluster admin approves "
            "them (the log says how).",
            show_default=False,
        ),
    ] = None,
    insecure_kubelet_api: Annotated[
        bool, typer.Option(help="Serve the kubelet API without authentication (DANGEROUS).")
    ] = False,
    kubelet_api: Annotated[bool, typer.Option(help="Serve the kubelet API at all.")] = True,
    bootstrap_kubeconfig: Annotated[
        Path | None,
        typer.Option(
            help="Bootstrap-token kubeconfig: obtain a system:node client certificate with a CSR "
            "and write --kubeconfig with it (like a kubelet)."
        ),
    ] = None,
    bootstrap_in_cluster: Annotated[
        bool,
        typer.Option(
            help="As --bootstrap-kubeconfig, with the pod's own service account (it needs create "
            "on certificatesigningrequests and certificatesigningrequests/nodeclient); with "
            "--leader-elect that account writes the Leases (the Helm chart's identity: node)."
        ),
    ] = False,
    log_format: Annotated[LogFormat, typer.Option(help="Log line format.")] = LogFormat.text,
    log_level: Annotated[str, typer.Option(help="debug, info, warning, error")] = "info",
    vm_controller: Annotated[
        bool,
        typer.Option(
            help="Also run the VirtualMachine controller in this process (leader-elected with "
            "any other instance; Lease in kube-system)."
        ),
    ] = False,
    leader_elect: Annotated[
        bool,
        typer.Option(
            help="Replicas with the same node(s) compete for a Lease; only the holder runs them "
            "(docs/high-availability.md)."
        ),
    ] = False,
    shard: Annotated[
        bool,
        typer.Option(
            help="Replicas with the same --config share its nodes, claimed in buckets through "
            "Leases, each taking its fair share (docs/high-availability.md)."
        ),
    ] = False,
    leader_elect_namespace: Annotated[
        str | None,
        typer.Option(help="Namespace of the Leases [default: $POD_NAMESPACE, else kube-system]."),
    ] = None,
    leader_elect_lease_duration: Annotated[
        float | None,
        typer.Option(help="Seconds a Lease unrenewed is free to take [default: 10; --shard 20]."),
    ] = None,
    leader_elect_renew_deadline: Annotated[
        float | None,
        typer.Option(help="A holder stops acting when it could not renew this long [7; 16]."),
    ] = None,
    leader_elect_retry_period: Annotated[
        float | None, typer.Option(help="Seconds between attempts and renewals [1.5; 4].")
    ] = None,
) -> None:
    """Run the node agent: register virtual node(s) and run their pods with a provider."""
    # Imported here so that `vkubelet dev ...` starts without loading the agent's dependencies.
    from .agent import Agent
    from .kube import ClientOptions
    from .node import (
        AgentConfig,
        ConfigError,
        NodeSettings,
        NodeSpec,
        ProviderLoadError,
        load_agent_config,
        parse_taint,
    )

    setup_logging(log_format, log_level)
    with _failing(ConfigError, ProviderLoadError, ValueError, OSError):
        if config is not None:
            agent_config = load_agent_config(config)
            if kubeconfig and agent_config.kubeconfig is None:
                agent_config.kubeconfig = kubeconfig
        else:
            if provider is None:
                raise ConfigError("--provider is required (or --config with a list of nodes)")
            labels = {}
            for item in label:
                key, sep, value = item.partition("=")
                if not sep or not key:
                    raise ConfigError(f"--label {item!r}: expected key=value")
                labels[key] = value
            taints: list[dict[str, str]] | None = [parse_taint(t) for t in taint] or None
            if disable_taint:
                taints = []
            agent_config = AgentConfig(
                nodes=[
                    NodeSpec(
                        NodeSettings(
                            name=nodename,
                            provider=provider,
                            labels=labels,
                            taints=taints,
                            kubelet_port=kubelet_port,
                            addresses=[
                                {"type": "InternalIP", "address": internal_ip},
                                {"type": "Hostname", "address": nodename},
                            ],
                        ),
                        provider_config,
                    )
                ],
                kubeconfig=kubeconfig,
                client=ClientOptions(qps=kube_api_qps, burst=kube_api_burst),
                workers=pod_sync_workers,
            )
        if tls_cert_file or tls_private_key_file:
            if not (tls_cert_file and tls_private_key_file):
                raise ConfigError("--tls-cert-file and --tls-private-key-file go together")
            agent_config.tls_cert_file = tls_cert_file
            agent_config.tls_key_file = tls_private_key_file
        if client_ca_file:
            agent_config.client_ca_file = client_ca_file
        if cert_dir:
            agent_config.cert_dir = cert_dir
        if approve_own_csrs is not None:
            agent_config.approve_csrs = approve_own_csrs
        if bootstrap_kubeconfig:
            agent_config.bootstrap_kubeconfig = bootstrap_kubeconfig
        agent_config.bootstrap_in_cluster |= bootstrap_in_cluster
        agent_config.insecure_kubelet_api |= insecure_kubelet_api
        agent_config.kubelet_api &= kubelet_api
        replicas = _replica_options(
            leader_elect or shard,
            shard,
            leader_elect_namespace,
            (leader_elect_lease_duration, leader_elect_renew_deadline, leader_elect_retry_period),
            kubelet_port,
        )
        if replicas is not None and agent_config.bootstrap_kubeconfig is not None:
            raise ConfigError(
                "--leader-elect/--shard need an identity allowed to write Leases, not a "
                "bootstrap (node) identity (--bootstrap-in-cluster writes them with the pod's "
                "service account)"
            )
        if replicas is not None and replicas.shard and agent_config.bootstrap_in_cluster:
            raise ConfigError("--shard shares several nodes; a node identity is one node's")
        hosted = [
            spec.settings.name
            for spec in agent_config.nodes
            if spec.settings.provider == "vm" and not _vm_fleet(spec.provider_config)
        ]
        if replicas is not None and hosted:
            # A standby elsewhere would boot every VM afresh, without the disks on this host.
            raise ConfigError(
                f"vm node {hosted[0]}: its VMs and their disks live on this host, so no replica "
                "may take it over (--leader-elect/--shard); run one agent per hypervisor host "
                "(docs/host-install.md)"
            )
        if replicas is not None and not replicas.shard:
            from .agent import agent_factory, run_leader_elected

            validated, make_agent = agent_factory(agent_config)

            async def run_agent() -> None:
                assert replicas is not None
                await run_leader_elected(validated, make_agent, replicas)
        else:
            agent = Agent(agent_config, replicas=replicas)
            run_agent = agent.run
    _tune_gc()
    if not vm_controller:
        _run_until_signalled(run_agent)
        return
    from .vmcontroller import ControllerConfig, run_controller

    async def agent_and_controller() -> None:
        async with _kube_client(kubeconfig) as client, asyncio.TaskGroup() as group:
            group.create_task(run_agent())
            group.create_task(run_controller(client, ControllerConfig()))

    _run_until_signalled(agent_and_controller)


def _replica_options(
    elect: bool,
    shard: bool,
    namespace: str | None,
    timing: tuple[float | None, float | None, float | None],
    health_port: int,
) -> ReplicaOptions | None:
    """How this replica coordinates with the others (None: it runs alone)."""
    import os

    from .agent import ReplicaOptions, leader_timing, shard_timing
    from .kube import LeaseTiming, default_identity
    from .node import ConfigError

    if not elect:
        return None
    default = shard_timing() if shard else leader_timing()
    duration, deadline, retry = timing
    lease = LeaseTiming(
        duration if duration is not None else default.duration,
        deadline if deadline is not None else default.renew_deadline,
        retry if retry is not None else default.retry,
    )
    if not 0 < lease.retry < lease.renew_deadline < lease.duration:
        raise ConfigError(
            "leader election: expected 0 < retry period < renew deadline < lease duration"
        )
    return ReplicaOptions(
        namespace=namespace or os.environ.get("POD_NAMESPACE") or "kube-system",
        identity=default_identity(),
        timing=lease,
        shard=shard,
        health_port=health_port,
    )


def _vm_fleet(path: Path | None) -> bool:
    """Whether a vm provider config is a fleet of libvirt hosts (`hosts`): its VMs and disks
    live on those hosts, not on the agent's, so a standby replica may take the nodes over."""
    if path is None:
        return False
    from .providers.vm import load_fleet

    return load_fleet(path) is not None


def _tune_gc() -> None:
    """What is loaded by now (modules, classes, the configuration) lives as long as the agent:
    frozen, full collections no longer scan it; and young collections run every 10,000
    allocations instead of 700, since an agent's churn (a watch event, a status patch) is
    almost all freed by reference counting first. With 10,000 pods the collector took 8 % of
    the agent's CPU before (bench/agent_vs_govk.py)."""
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)


# SIGTERM or SIGINT to exit, whatever the agent's providers and VMs are doing (systemd's
# TimeoutStopSec and a pod's grace period are larger): the orderly stop gets most of it.
STOP_SECONDS = 8.0


def _run_until_signalled(run: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run the agent until SIGTERM or SIGINT, then let it stop in order (its controllers, its
    kubelet servers, every provider's `aclose`) within `STOP_SECONDS`: the process exits 0, or
    1 when the bound cut the stop short (what still ran is logged by name)."""
    from .sdk.tasks import run_until_signalled

    def stopping(sig: signal.Signals) -> None:
        err.print(f"{sig.name}: stopping", highlight=False, markup=False)

    if not run_until_signalled(run, grace=STOP_SECONDS, on_signal=stopping):
        raise typer.Exit(1)


@app.command()
def providers() -> None:
    """List the providers installed (entry points `vkubelet.providers`)."""
    from .node import available_providers

    for name, entry in sorted(available_providers().items()):
        out.print(f"{name}\t{entry.value}", highlight=False)


@dev.command("build")
def dev_build(
    workers: Annotated[
        bool,
        typer.Option(
            "--workers",
            help="Also what worker nodes run: kubelet, kube-proxy, containerd, CoreDNS, pause.",
        ),
    ] = False,
    helm: Annotated[
        bool,
        typer.Option("--helm", help="Also helm, for installing the chart (none needed on PATH)."),
    ] = False,
) -> None:
    """Build (or find cached) control-plane binaries without starting anything."""
    from .devcluster import DevClusterError, ensure_binaries, ensure_helm, ensure_worker_binaries

    with _failing(DevClusterError):
        binaries = ensure_binaries(_progress)
        more = ensure_worker_binaries(_progress) if workers else {}
        if helm:
            more["helm"] = ensure_helm(_progress)
    out.print(f"Kubernetes {binaries.kubernetes_version} binaries in {binaries.directory}")
    for name, path in more.items():
        out.print(f"{name}: {path}", highlight=False)


@image_app.command("build")
def image_build(
    kind: Annotated[str, typer.Argument(help="busybox, pause or agent (this source tree).")],
    force: Annotated[bool, typer.Option(help="Rebuild even when cached.")] = False,
) -> None:
    """Build an OCI image archive from Debian packages (or this tree); prints its path."""
    from .devcluster import DevClusterError, build_image

    with _failing(DevClusterError):
        image = build_image(kind, _progress, force=force)
    out.print(f"{image.reference}\t{image.digest}\t{image.path}", highlight=False)


@image_app.command("load")
def image_load(
    image: Annotated[
        str,
        typer.Argument(help="busybox, pause, agent (built first if needed) or an image archive."),
    ],
    name: NameOption = "default",
) -> None:
    """Load an image into every worker's containerd (pods use it with imagePullPolicy
    IfNotPresent or Never); workers started later get it too."""
    from .devcluster import KINDS, Cluster, DevClusterError, build_image

    with _failing(DevClusterError):
        if image in KINDS:
            built = build_image(image, _progress)
            archive, what = built.path, built.reference
        else:
            archive, what = Path(image), image
        names = Cluster(name).load_image(archive)
    out.print(f"Loaded {what} into {', '.join(names)}", highlight=False)


@dev.command("vm-image")
def dev_vm_image(
    out_dir: Annotated[
        Path | None,
        typer.Option("--out", help="Cache directory (default: ~/.cache/vkubelet/vm-images)."),
    ] = None,
    force: Annotated[bool, typer.Option(help="Rebuild even when cached.")] = False,
    distro: Annotated[
        bool,
        typer.Option(help="The Debian guest with cloud-init instead (debootstrap, minutes)."),
    ] = False,
) -> None:
    """Build (or find cached) a test guest for the vm provider; prints its qcow2 path."""
    from .vmimage import ImageBuildError, build_distro_image, build_guest_image

    build = build_distro_image if distro else build_guest_image
    with _failing(ImageBuildError):
        image = build(out_dir, _progress, force=force)
    out.print(str(image.disk), highlight=False)


@cluster_app.command("up")
def cluster_up(
    name: NameOption = "default",
    apiserver_port: Annotated[
        int | None,
        typer.Option(
            help="Port for kube-apiserver on 127.0.0.1 (default: a free one).", min=1, max=65535
        ),
    ] = None,
    workers: Annotated[
        int,
        typer.Option(
            help="Real worker nodes (kubelet, containerd, kube-proxy; CoreDNS for the cluster) "
            "on a pod network of this machine; needs root. Again on a running cluster: adds "
            "missing workers and restarts dead worker components.",
            min=0,
        ),
    ] = 0,
    node_monitor_grace_period: Annotated[
        int | None,
        typer.Option(
            help="Seconds without a lease renewal before a node is marked NotReady (default: "
            "Kubernetes' 50); at least 20, as nodes renew every 10 s. Set when the cluster "
            "starts; a reused cluster keeps its own.",
            min=20,
            max=3600,
        ),
    ] = None,
) -> None:
    """Start a local cluster (or reuse it if it is up) and print how to use it."""
    from .devcluster import Cluster, DevClusterError

    # Tests of node health wait for NotReady: a shorter grace period saves them most of it.
    extra_args: dict[str, list[str]] = {}
    if node_monitor_grace_period is not None:
        flag = f"--node-monitor-grace-period={node_monitor_grace_period}s"
        extra_args["kube-controller-manager"] = [flag]
    try:
        cluster = Cluster(name)
        cluster.up(
            apiserver_port=apiserver_port,
            workers=workers,
            progress=_progress,
            extra_args=extra_args,
        )
    except DevClusterError as e:
        raise _fail(e) from None
    except KeyboardInterrupt:
        err.print("interrupted; everything that was started has been stopped")
        raise typer.Exit(130) from None
    flag = "" if name == "default" else f" --name {name}"
    out.print(
        f"\nCluster [bold]{name}[/] is up: {cluster.server} "
        f"(Kubernetes {cluster.kubernetes_version})\n\n"
        f"  export KUBECONFIG={cluster.kubeconfig}\n"
        "  kubectl get --raw /readyz\n"
        "  kubectl get nodes\n\n"
        + (
            "Worker nodes have the images vkubelet.local/busybox and vkubelet.local/pause; "
            f"load more with `vkubelet dev image load <archive|agent>{flag}`.\n"
            f"  kubectl run web --image={cluster.image_reference('busybox')} -- httpd -f -p 80\n"
            f"VM nodes on this machine: a /24 of {cluster.virtual_pod_cidr()} as podCIDR "
            "(routed from the workers).\n\n"
            if cluster.workers()
            else ""
        )
        + f"Status: vkubelet dev cluster status{flag}\n"
        f"Stop:   vkubelet dev cluster down{flag}",
        highlight=False,
    )


@cluster_app.command("down")
def cluster_down(name: NameOption = "default") -> None:
    """Stop every process of a cluster and delete its state."""
    from .devcluster import Cluster, DevClusterError

    with _failing(DevClusterError):
        Cluster(name).down()
    out.print(f"Cluster {name} is down.")


@cluster_app.command("status")
def cluster_status(name: NameOption = "default") -> None:
    """Show each component's health. Exits 1 if any component is not healthy."""
    from rich.table import Table

    from .devcluster import Cluster, DevClusterError

    with _failing(DevClusterError):
        cluster = Cluster(name)
        status = cluster.status()
    table = Table(title=f"cluster {name} — {cluster.server}")
    table.add_column("component")
    table.add_column("state")
    for component, state in status.items():
        colour = "green" if state == "healthy" else "red"
        table.add_row(component, f"[{colour}]{state}[/]")
    out.print(table)
    out.print(f"KUBECONFIG={cluster.kubeconfig}", highlight=False)
    if any(state != "healthy" for state in status.values()):
        raise typer.Exit(1)


@cluster_app.command("bootstrap-kubeconfig")
def cluster_bootstrap_kubeconfig(
    output: Annotated[Path, typer.Option("--out", help="Where to write the kubeconfig.")],
    name: NameOption = "default",
) -> None:
    """Write a kubeconfig with a new bootstrap token, for `vkubelet run --bootstrap-kubeconfig`."""
    from .devcluster import Cluster, DevClusterError

    with _failing(DevClusterError):
        output.parent.mkdir(parents=True, exist_ok=True)
        path = Cluster(name).bootstrap_kubeconfig(output)
    out.print(f"Bootstrap kubeconfig written to {path} (valid 24 h).", highlight=False)


@cluster_app.command("list")
def cluster_list() -> None:
    """List local clusters."""
    from rich.table import Table

    from .devcluster import list_clusters

    clusters = list_clusters()
    if not clusters:
        out.print("No clusters. Start one with: vkubelet dev cluster up")
        return
    table = Table()
    for column in ("name", "state", "server", "kubeconfig"):
        table.add_column(column)
    for cluster in clusters:
        table.add_row(
            cluster.name,
            "up" if cluster.is_up() else "stopped",
            cluster.server,
            str(cluster.kubeconfig),
        )
    out.print(table)


def _kube_client(kubeconfig: Path | None) -> KubeClient:
    from .kube import KubeClient

    return KubeClient.from_kubeconfig(kubeconfig)


@vm_app.command("install-crds")
def vm_install_crds(
    kubeconfig: KubeconfigOption = None,
    print_only: Annotated[
        bool, typer.Option("--print", help="Print the CRDs' YAML instead of installing them.")
    ] = False,
) -> None:
    """Install (server-side apply) the VirtualMachine, VirtualMachineBackup and
    VirtualMachineMigration CRDs and wait until they are Established."""
    from .vmcontroller import crd_yaml, install_crds

    if print_only:
        out.print(crd_yaml(), highlight=False, markup=False, end="")
        return

    async def install() -> list[str]:
        async with _kube_client(kubeconfig) as client:
            return await install_crds(client)

    with _failing(Exception):
        names = asyncio.run(install())
    for name in names:
        out.print(f"{name} established", highlight=False)


@vm_app.command("import")
def vm_import(
    domain: Annotated[str, typer.Argument(help="The libvirt domain's name on the node's host.")],
    node: Annotated[str, typer.Option(help="The vm node whose libvirt host defines it.")],
    name: Annotated[
        str | None, typer.Option(help="The VirtualMachine's name (default: from the domain's).")
    ] = None,
    namespace: Annotated[str, typer.Option("--namespace", "-n")] = "default",
    deletion_policy: Annotated[
        str,
        typer.Option(
            help="Deleting the VirtualMachine: Retain (the domain stays defined) or Delete."
        ),
    ] = "Retain",
    replicas: Annotated[
        int, typer.Option(min=0, max=1, help="1: start it (one that runs is taken as it runs).")
    ] = 1,
    cpu: Annotated[str | None, typer.Option(help="What the scheduler counts for it.")] = None,
    memory: Annotated[str | None, typer.Option(help="What the scheduler counts for it.")] = None,
    wait: Annotated[
        bool, typer.Option(help="Wait until it runs, or the node refuses it (then it is deleted).")
    ] = True,
    timeout: Annotated[float, typer.Option(help="Seconds to wait.")] = 300.0,
    print_only: Annotated[
        bool, typer.Option("--print", help="Print the VirtualMachine's YAML, create nothing.")
    ] = False,
    kubeconfig: KubeconfigOption = None,
) -> None:
    """Bring an existing libvirt domain (one vkubelet did not make) under a VirtualMachine:
    replicas power it, kubectl exec and logs work on its pod (docs/vm-resource.md)."""
    import yaml

    from .vmcontroller import import_manifest, import_vm, vm_name_for

    if deletion_policy not in ("Retain", "Delete"):
        raise _fail(ValueError(f"--deletion-policy: {deletion_policy!r} is not Retain or Delete"))
    with _failing(ValueError):
        manifest = import_manifest(
            domain,
            node,
            name=name or vm_name_for(domain),
            namespace=namespace,
            deletion_policy=deletion_policy,
            replicas=replicas,
            cpu=cpu,
            memory=memory,
        )
    if print_only:
        out.print(yaml.safe_dump(manifest, sort_keys=False), highlight=False, markup=False, end="")
        return

    async def create() -> Any:
        async with _kube_client(kubeconfig) as client:
            return await import_vm(client, manifest, wait_seconds=timeout if wait else None)

    with _failing(Exception):
        result = asyncio.run(create())
    vm = f"virtualmachine/{manifest['metadata']['name']}"
    if result.running or result.reason == "Created":
        out.print(f"{vm}: domain {domain} imported: {result.message}", highlight=False)
        return
    if result.reason == "Timeout":
        raise _fail(RuntimeError(f"{vm}: {result.message}"))
    raise _fail(
        RuntimeError(
            f"{vm}: node {node} refused domain {domain} ({result.reason}): {result.message}; "
            "the VirtualMachine was deleted, the domain is unchanged"
        )
    )


def _own_executable() -> Path:
    """This `vkubelet` (a venv's, pipx's, a package's), for a unit's ExecStart."""
    started = Path(sys.argv[0])
    if started.name == "vkubelet" and started.exists():
        return started.absolute()
    return Path(sys.prefix) / "bin" / "vkubelet"


@host_app.command("install")
def host_install(
    config: Annotated[
        Path,
        typer.Option(
            help="The agent config (YAML) the service runs, e.g. /etc/vkubelet/agent.yaml."
        ),
    ],
    bootstrap_kubeconfig: Annotated[
        Path | None,
        typer.Option(help="Bootstrap credentials: the node obtains its own identity from them."),
    ] = None,
    unit_dir: Annotated[Path, typer.Option(help="Where the units go.")] = Path(
        "/etc/systemd/system"
    ),
    start: Annotated[
        bool, typer.Option(help="Enable and (re)start the service (else only write the units).")
    ] = True,
) -> None:
    """Install the agent as the systemd service `vkubelet` (VMs outlive its restarts) and start
    it: one agent per hypervisor host."""
    from .agent._hostinstall import install
    from .node import ConfigError

    with _failing(ConfigError, OSError, subprocess.CalledProcessError):
        written = install(
            config,
            executable=_own_executable(),
            unit_dir=unit_dir,
            bootstrap_kubeconfig=bootstrap_kubeconfig,
            start=start,
        )
    for path in written:
        out.print(f"wrote {path}", highlight=False)
    if start:
        out.print("started vkubelet.service: journalctl -u vkubelet -f", highlight=False)


@app.command("vm-controller")
def vm_controller(
    kubeconfig: KubeconfigOption = None,
    lease_namespace: Annotated[
        str, typer.Option(envvar="POD_NAMESPACE", help="Namespace of the leader-election Lease.")
    ] = "kube-system",
    namespace: Annotated[
        str | None, typer.Option(help="Only this namespace's VMs (default: all).")
    ] = None,
    identity: Annotated[
        str | None, typer.Option(help="Leader-election identity (default: host-pid-random).")
    ] = None,
    lease_duration: Annotated[
        float,
        typer.Option(
            min=1.0, help="Seconds an unrenewed Lease stays the leader's (failover time)."
        ),
    ] = 15.0,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING, ERROR.")] = "INFO",
) -> None:
    """Run the VirtualMachine controller (one active instance by leader election)."""
    from .kube import LeaseTiming
    from .vmcontroller import ControllerConfig, run_controller

    setup_logging(LogFormat.text, log_level)
    for noisy in ("httpx", "httpx2", "httpcore", "httpcore2"):  # every request, at DEBUG
        logging.getLogger(noisy).setLevel(logging.WARNING)
    config = ControllerConfig(
        lease_namespace=lease_namespace,
        namespace=namespace,
        identity=identity or "",
        timing=LeaseTiming.for_duration(lease_duration),
    )

    async def controller() -> None:
        async with _kube_client(kubeconfig) as client:
            await run_controller(client, config)

    _run_until_signalled(controller)


def main() -> None:
    app()
