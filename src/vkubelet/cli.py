"""The `vkubelet` command line."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from . import __version__
from .devcluster import Cluster, DevClusterError, ensure_binaries, list_clusters

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
app.add_typer(dev, name="dev")
dev.add_typer(cluster_app, name="cluster")

# Piped output must not be wrapped at 80 columns: users copy these commands and paths.
out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 250)
err = Console(stderr=True, soft_wrap=True, width=None if sys.stderr.isatty() else 250)

NameOption = Annotated[
    str, typer.Option("--name", "-n", help="Cluster name; several can run side by side.")
]


def _fail(error: Exception) -> typer.Exit:
    err.print(f"[bold red]error:[/] {error}", highlight=False, markup=True, soft_wrap=True)
    return typer.Exit(1)


def _progress(message: str) -> None:
    err.print(message, highlight=False, markup=False)


@app.command()
def version() -> None:
    """Print vkubelet's version."""
    out.print(__version__)


@dev.command("build")
def dev_build() -> None:
    """Build (or find cached) control-plane binaries without starting anything."""
    try:
        binaries = ensure_binaries(_progress)
    except DevClusterError as e:
        raise _fail(e) from None
    out.print(f"Kubernetes {binaries.kubernetes_version} binaries in {binaries.directory}")


@cluster_app.command("up")
def cluster_up(
    name: NameOption = "default",
    apiserver_port: Annotated[
        int | None,
        typer.Option(
            help="Port for kube-apiserver on 127.0.0.1 (default: a free one).", min=1, max=65535
        ),
    ] = None,
) -> None:
    """Start a local cluster and print how to use it."""
    try:
        cluster = Cluster(name)
        cluster.up(apiserver_port=apiserver_port, progress=_progress)
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
        f"Status: vkubelet dev cluster status{flag}\n"
        f"Stop:   vkubelet dev cluster down{flag}",
        highlight=False,
    )


@cluster_app.command("down")
def cluster_down(name: NameOption = "default") -> None:
    """Stop every process of a cluster and delete its state."""
    try:
        Cluster(name).down()
    except DevClusterError as e:
        raise _fail(e) from None
    out.print(f"Cluster {name} is down.")


@cluster_app.command("status")
def cluster_status(name: NameOption = "default") -> None:
    """Show each component's health. Exits 1 if any component is not healthy."""
    try:
        cluster = Cluster(name)
        status = cluster.status()
    except DevClusterError as e:
        raise _fail(e) from None
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


@cluster_app.command("list")
def cluster_list() -> None:
    """List local clusters."""
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


def main() -> None:
    app()
