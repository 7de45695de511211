"""Build the control-plane binaries from their Go modules, once per version.

No package registry ships kube-apiserver, so the Go module next to this file pins one Kubernetes
release (and the etcd it was tested with) and we compile it. A cold build takes many minutes on
two cores; the result is cached under a key derived from go.mod/go.sum so that later runs start
in seconds and a change of version rebuilds by itself.
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

GO_MODULE_DIR = Path(__file__).parent / "go"

# Binary name -> Go package. etcd comes from the same module graph as the apiserver, so it is
# exactly the etcd release this Kubernetes version requires (Debian's 3.4 is too old).
PACKAGES: dict[str, str] = {
    "etcd": "go.etcd.io/etcd/server/v3",
    "kube-apiserver": "k8s.io/kubernetes/cmd/kube-apiserver",
    "kube-scheduler": "k8s.io/kubernetes/cmd/kube-scheduler",
    "kube-controller-manager": "k8s.io/kubernetes/cmd/kube-controller-manager",
}

Progress = Callable[[str], None]


class GoToolchainMissing(DevClusterError):
    pass


class BuildFailed(DevClusterError):
    pass


@dataclass(frozen=True)
class Binaries:
    directory: Path
    kubernetes_version: str

    def path(self, name: str) -> Path:
        return self.directory / name


def kubernetes_version() -> str:
    match = re.search(r"^require k8s\.io/kubernetes (v\S+)", _go_mod(), re.MULTILINE)
    if not match:
        raise BuildFailed(f"{GO_MODULE_DIR / 'go.mod'} does not pin k8s.io/kubernetes")
    return match.group(1)


def _go_mod() -> str:
    return (GO_MODULE_DIR / "go.mod").read_text()


def _required_go() -> tuple[int, int]:
    match = re.search(r"^go (\d+)\.(\d+)", _go_mod(), re.MULTILINE)
    return (int(match.group(1)), int(match.group(2))) if match else (1, 0)


def cache_root() -> Path:
    env = os.environ.get("VKUBELET_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "vkubelet"


def _build_key() -> str:
    digest = hashlib.sha256()
    for name in ("go.mod", "go.sum"):
        digest.update((GO_MODULE_DIR / name).read_bytes())
    return digest.hexdigest()[:12]


def cached_binaries() -> Binaries | None:
    """The cached build for the pinned version, if it is complete."""
    version = kubernetes_version()
    directory = cache_root() / f"k8s-{version}-{_build_key()}"
    if all((directory / name).is_file() for name in PACKAGES):
        return Binaries(directory, version)
    return None


def find_go() -> Path:
    go = shutil.which("go")
    if go is None:
        raise GoToolchainMissing(
            "the Go toolchain ('go') is not on PATH. vkubelet builds kube-apiserver, "
            "kube-scheduler, kube-controller-manager and etcd from their Go modules the first "
            f"time (then caches them under {cache_root()}); install Go "
            f"{'.'.join(map(str, _required_go()))} or newer and try again."
        )
    out = subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True, check=False)
    match = re.match(r"go(\d+)\.(\d+)", out.stdout.strip())
    if out.returncode != 0 or not match:
        raise GoToolchainMissing(f"{go} does not work: {out.stderr.strip() or out.stdout.strip()}")
    have = (int(match.group(1)), int(match.group(2)))
    need = _required_go()
    if have < need:
        raise GoToolchainMissing(
            f"{go} is {out.stdout.strip()}, but Kubernetes {kubernetes_version()} needs "
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


def ensure_binaries(progress: Progress = print) -> Binaries:
    """Return the cached binaries, building whatever is missing first."""
    found = cached_binaries()
    if found:
        return found
    version = kubernetes_version()
    directory = cache_root() / f"k8s-{version}-{_build_key()}"
    go = find_go()
    with _locked(cache_root() / "build.lock"):
        missing = [name for name in PACKAGES if not (directory / name).is_file()]
        if not missing:  # another process built them while we waited for the lock
            return Binaries(directory, version)
        directory.mkdir(parents=True, exist_ok=True)
        progress(
            f"Building Kubernetes {version} control plane from Go modules into {directory} "
            "(first time only; a cold build takes 10-25 minutes on 2 cores)"
        )
        started = time.monotonic()
        for index, name in enumerate(missing, 1):
            _build_one(go, name, version, directory, progress, f"{index}/{len(missing)}")
        progress(f"Control plane built in {_minutes(time.monotonic() - started)}")
    return Binaries(directory, version)


def _ldflags(version: str) -> str:
    """Stamp the version like Kubernetes' own build does, so `kubectl version` tells the truth."""
    major, minor = version.lstrip("v").split(".")[:2]
    flags = ["-s", "-w"]
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [
            f"-X {pkg}.gitVersion={version}",
            f"-X {pkg}.gitMajor={major}",
            f"-X {pkg}.gitMinor={minor}",
            f"-X {pkg}.gitTreeState=clean",
        ]
    return " ".join(flags)


def _build_one(
    go: Path, name: str, version: str, directory: Path, progress: Progress, counter: str
) -> None:
    started = time.monotonic()
    progress(f"[{counter}] go build {PACKAGES[name]} ...")
    env = os.environ | {
        "GOTOOLCHAIN": "local",  # never try to download another toolchain
        "CGO_ENABLED": "0",
        "GOFLAGS": "-mod=readonly",
    }
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        out = Path(tmp) / name
        cmd = [str(go), "build", "-v", "-trimpath", "-ldflags", _ldflags(version)]
        cmd += ["-o", str(out), PACKAGES[name]]
        proc = subprocess.Popen(
            cmd,
            cwd=GO_MODULE_DIR,
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
