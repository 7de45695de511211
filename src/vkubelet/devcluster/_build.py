"""Build the control-plane binaries from their Go modules, once per version.

No package registry ships kube-apiserver, so a Go module next to this file (`go/`) pins one
Kubernetes release (and the etcd it was tested with) and we compile it; another (`go-metrics/`)
pins metrics-server, which `kubectl top` needs. metrics-server has a module of its own because it
pins its own k8s.io libraries, which need not match the control plane's. A cold build takes many
minutes on two cores; each module's binaries are cached under a key derived from its
go.mod/go.sum, so later runs start in seconds and a change of version rebuilds by itself.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ._errors import DevClusterError

Progress = Callable[[str], None]


class GoToolchainMissing(DevClusterError):
    pass


class BuildFailed(DevClusterError):
    pass


@dataclass(frozen=True)
class GoModule:
    """A Go module directory next to this file and the binaries built from it."""

    cache_prefix: str  # the cache directory is <prefix>-<version>-<key of the module's files>
    directory: Path
    pinned: str  # the module whose version names the build ("" for a program of our own)
    packages: dict[str, str]  # binary name -> Go package
    version_packages: tuple[str, ...]  # packages whose version variables we stamp
    version_variables: tuple[str, ...] = ()  # further variables set to the version (helm's)
    build_tags: tuple[str, ...] = ()

    def go_mod(self) -> str:
        return (self.directory / "go.mod").read_text()

    def sources(self) -> list[Path]:
        """What the build depends on besides the module graph: our own main packages, if any."""
        return sorted(self.directory.glob("*.go"))

    def version(self) -> str:
        if not self.pinned:
            return "v0"
        pattern = rf"^(?:require\s+|\t){re.escape(self.pinned)} (v\S+)"
        match = re.search(pattern, self.go_mod(), re.MULTILINE)
        if not match:
            raise BuildFailed(f"{self.directory / 'go.mod'} does not pin {self.pinned}")
        return match.group(1)

    def required_go(self) -> tuple[int, int]:
        match = re.search(r"^go (\d+)\.(\d+)", self.go_mod(), re.MULTILINE)
        return (int(match.group(1)), int(match.group(2))) if match else (1, 0)

    def cache_dir(self) -> Path:
        digest = hashlib.sha256()
        for name in ("go.mod", "go.sum"):
            if (self.directory / name).exists():  # a module without dependencies has no go.sum
                digest.update((self.directory / name).read_bytes())
        for source in self.sources():
            digest.update(source.name.encode() + b"\0" + source.read_bytes())
        return cache_root() / f"{self.cache_prefix}-{self.version()}-{digest.hexdigest()[:12]}"

    def paths(self) -> dict[str, Path]:
        """Where its binaries are cached (once built): name -> file."""
        directory = self.cache_dir()
        return {name: directory / name for name in self.packages}

    def missing(self) -> list[str]:
        return [name for name, path in self.paths().items() if not path.is_file()]


KUBERNETES = GoModule(
    cache_prefix="k8s",
    directory=Path(__file__).parent / "go",
    pinned="k8s.io/kubernetes",
    # etcd comes from the same module graph as the apiserver, so it is exactly the etcd release
    # this Kubernetes version requires (Debian's 3.4 is too old).
    packages={
        "etcd": "go.etcd.io/etcd/server/v3",
        "kube-apiserver": "k8s.io/kubernetes/cmd/kube-apiserver",
        "kube-scheduler": "k8s.io/kubernetes/cmd/kube-scheduler",
        "kube-controller-manager": "k8s.io/kubernetes/cmd/kube-controller-manager",
    },
    version_packages=("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"),
)
METRICS_SERVER = GoModule(
    cache_prefix="metrics-server",
    directory=Path(__file__).parent / "go-metrics",
    pinned="sigs.k8s.io/metrics-server",
    packages={"metrics-server": "sigs.k8s.io/metrics-server/cmd/metrics-server"},
    # As metrics-server's own Makefile stamps it (its user agent and `--version`).
    version_packages=("k8s.io/client-go/pkg/version",),
)
# Helm renders and lints the chart under deploy/helm (tests, `make manifests`); not part of a
# cluster, so built only when asked for (`ensure_tool`), but cached the same way.
HELM = GoModule(
    cache_prefix="helm",
    directory=Path(__file__).parent / "go-helm",
    pinned="helm.sh/helm/v3",
    packages={"helm": "helm.sh/helm/v3/cmd/helm"},
    version_packages=(),
    version_variables=("helm.sh/helm/v3/internal/version.version",),
)
# What a worker node runs (`vkubelet dev cluster up --workers N`), built only when a cluster has
# workers. The kubelet and kube-proxy come from the control plane's own module, so they are
# always the same release as the apiserver.
NODE = GoModule(
    cache_prefix="k8s-node",
    directory=KUBERNETES.directory,
    pinned="k8s.io/kubernetes",
    packages={
        "kubelet": "k8s.io/kubernetes/cmd/kubelet",
        "kube-proxy": "k8s.io/kubernetes/cmd/kube-proxy",
    },
    version_packages=KUBERNETES.version_packages,
)
CONTAINERD = GoModule(
    cache_prefix="containerd",
    directory=Path(__file__).parent / "go-containerd",
    pinned="github.com/containerd/containerd/v2",
    packages={
        "containerd": "github.com/containerd/containerd/v2/cmd/containerd",
        "containerd-shim-runc-v2": (
            "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
        ),
        "ctr": "github.com/containerd/containerd/v2/cmd/ctr",
    },
    version_packages=(),
    version_variables=("github.com/containerd/containerd/v2/version.Version",),
    # btrfs needs cgo headers; workers use the overlayfs snapshotter.
    build_tags=("no_btrfs",),
)
COREDNS = GoModule(
    cache_prefix="coredns",
    directory=Path(__file__).parent / "go-coredns",
    pinned="github.com/coredns/coredns",
    packages={"coredns": "vkubelet.local/tools/coredns"},
    version_packages=(),
)
PAUSE = GoModule(
    cache_prefix="pause",
    directory=Path(__file__).parent / "go-pause",
    pinned="",
    packages={"pause": "vkubelet.local/tools/pause"},
    version_packages=(),
)
WORKER_MODULES = (NODE, CONTAINERD, COREDNS, PAUSE)
MODULES = (KUBERNETES, METRICS_SERVER)


@dataclass(frozen=True)
class Binaries:
    paths: dict[str, Path]  # binary name -> file
    kubernetes_version: str

    @property
    def directory(self) -> Path:
        """Where the Kubernetes binaries are."""
        return self.paths["kube-apiserver"].parent


def kubernetes_version() -> str:
    return KUBERNETES.version()


def cache_root() -> Path:
    env = os.environ.get("VKUBELET_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "vkubelet"


def _binaries() -> Binaries:
    return Binaries(KUBERNETES.paths() | METRICS_SERVER.paths(), KUBERNETES.version())


def find_go(need: tuple[int, int] | None = None) -> Path:
    """The Go toolchain on PATH, if it is at least `need` (default: what every module needs)."""
    need = need or max(m.required_go() for m in MODULES)
    go = shutil.which("go")
    if go is None:
        raise GoToolchainMissing(
            "the Go toolchain ('go') is not on PATH. vkubelet builds kube-apiserver, "
            "kube-scheduler, kube-controller-manager, etcd and metrics-server from their Go "
            f"modules the first time (then caches them under {cache_root()}); install Go "
            f"{'.'.join(map(str, need))} or newer and try again."
        )
    out = subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True, check=False)
    match = re.match(r"go(\d+)\.(\d+)", out.stdout.strip())
    if out.returncode != 0 or not match:
        raise GoToolchainMissing(f"{go} does not work: {out.stderr.strip() or out.stdout.strip()}")
    have = (int(match.group(1)), int(match.group(2)))
    if have < need:
        raise GoToolchainMissing(
            f"{go} is {out.stdout.strip()}, but the pinned control plane needs "
            f"go{need[0]}.{need[1]} or newer"
        )
    return Path(go)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Serialise builds between processes (a CLI and a test run may both want the binaries)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build_missing(
    modules: tuple[GoModule, ...],
    progress: Progress,
    announce: Callable[[str], str] | None = None,
) -> None:
    """Build the binaries of `modules` that are not cached yet; `announce(names)` says so first,
    then how long it took."""
    if not any(m.missing() for m in modules):
        return
    go = find_go(max(m.required_go() for m in modules if m.missing()))
    with _locked(cache_root() / "build.lock"):
        # Another process may have built some while we waited for the lock.
        todo = [(m, name) for m in modules for name in m.missing()]
        if not todo:
            return
        if announce:
            progress(announce(", ".join(name for _, name in todo)))
        started = time.monotonic()
        for index, (module, name) in enumerate(todo, 1):
            _build_one(go, module, name, progress, f"{index}/{len(todo)}")
        if announce:
            progress(f"Built in {_minutes(time.monotonic() - started)}")


def ensure_binaries(progress: Progress = print) -> Binaries:
    """Return the cached binaries, building whatever is missing first."""
    _build_missing(
        MODULES,
        progress,
        lambda names: (
            f"Building {names} from Go modules into {cache_root()} (first time only; "
            "a cold build of the whole control plane takes 10-25 minutes on 2 cores)"
        ),
    )
    return _binaries()


def ensure_tool(module: GoModule, progress: Progress = print) -> dict[str, Path]:
    """A tool's cached binaries (name -> file), building them first if missing (minutes once)."""
    _build_missing((module,), progress)
    return module.paths()


def ensure_worker_binaries(progress: Progress = print) -> dict[str, Path]:
    """What worker nodes run (kubelet, kube-proxy, containerd, CoreDNS, pause): name -> file.

    Built once (about 8 minutes cold on 2 cores), then cached like the control plane.
    """
    missing = [name for module in WORKER_MODULES for name in module.missing()]
    if missing:
        progress(
            f"Building {', '.join(missing)} for worker nodes into {cache_root()} (first time "
            "only; about 8 minutes on 2 cores)"
        )
    for module in WORKER_MODULES:
        ensure_tool(module, progress)
    return worker_binaries()


def worker_binaries() -> dict[str, Path]:
    """Where what worker nodes run is cached (once built): name -> file."""
    return {name: path for module in WORKER_MODULES for name, path in module.paths().items()}


def ensure_helm(progress: Progress = print) -> Path:
    """The pinned helm binary (go-helm/go.mod), built the first time (about 5 minutes)."""
    return ensure_tool(HELM, progress)["helm"]


def _ldflags(module: GoModule) -> str:
    """Stamp the version like the projects' own builds do, so `kubectl version` tells the truth."""
    version = module.version()
    flags = ["-s", "-w"]
    for pkg in module.version_packages:
        major, minor = version.lstrip("v").split(".")[:2]
        flags += [
            f"-X {pkg}.gitVersion={version}",
            f"-X {pkg}.gitMajor={major}",
            f"-X {pkg}.gitMinor={minor}",
            f"-X {pkg}.gitTreeState=clean",
        ]
    flags += [f"-X {variable}={version}" for variable in module.version_variables]
    return " ".join(flags)


def _build_one(go: Path, module: GoModule, name: str, progress: Progress, counter: str) -> None:
    started = time.monotonic()
    directory = module.cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    progress(f"[{counter}] go build {module.packages[name]} ({module.version()}) ...")
    env = os.environ | {
        "GOTOOLCHAIN": "local",  # never try to download another toolchain
        "CGO_ENABLED": "0",
        "GOFLAGS": "-mod=readonly",
    }
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        out = Path(tmp) / name
        # -buildvcs=false: our own programs (pause, CoreDNS's main) live in this repository, and
        # a stamped commit would change the binary (and the pause image) at every commit.
        cmd = [str(go), "build", "-v", "-trimpath", "-buildvcs=false", "-ldflags", _ldflags(module)]
        if module.build_tags:
            cmd += ["-tags", ",".join(module.build_tags)]
        cmd += ["-o", str(out), module.packages[name]]
        proc = subprocess.Popen(
            cmd,
            cwd=module.directory,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stderr is not None
        tail: list[str] = []
        last_report = time.monotonic()
        # `go build -v` names each package as it compiles it: a cheap progress signal.
        for compiled, line in enumerate(proc.stderr, 1):
            tail = [*tail[-40:], line.rstrip()]
            if time.monotonic() - last_report > 30:
                last_report = time.monotonic()
                elapsed = _minutes(time.monotonic() - started)
                progress(f"[{counter}] {name}: {compiled} packages compiled, {elapsed}")
        if proc.wait() != 0:
            raise BuildFailed(f"building {name} failed:\n" + "\n".join(tail[-25:]))
        out.replace(directory / name)  # atomic: a half-written binary is never cached
    progress(f"[{counter}] {name} built in {_minutes(time.monotonic() - started)}")


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
