"""pytest plugin: SSH "devices" for providers that manage machines over SSH.

Each device is a real sshd in its own network namespace, running as its own user, with a key to
log in and a known_hosts file to verify it, and a link the test can take down (`ssh_lab` outside
of pytest). Needs root, iproute2 and openssh-server. Not loaded by default: a suite enables it with

    pytest_plugins = ["vkubelet.testing.sshlab"]

and then gets the `ssh_devices` fixture.

A lab may be *routed* (`routed_in`): its devices then take their addresses from a dev cluster's
virtual pod range and the host forwards what they send, so the cluster's worker pods reach them
as they reach any virtual node's pods (the address is the device pods' IP).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pytest

from . import _claim_subnet, _ip, _must

# --- SSH device lab --------------------------------------------------------------------------
#
# Real sshd processes, one per "device", each in its own network namespace and running as its own
# unprivileged user, so the SSH provider is tested against what it meets in the field: a separate
# host it reaches over a network link that can fail, a user without root, host keys to verify.

SSHD = "/usr/sbin/sshd"
SSH_DEVICE_PORT = 2222
#: The third octets of a routed lab's /30s in its /16: clear of the /24s vm nodes take in tests
#: (1-249) and bench/pod_network.py (.252), and of the stand-in VM `virtual_pod` (.250).
_ROUTED_THIRD = range(253, 255)
_STD_PATH = "/usr/local/bin:/usr/bin:/bin"


@dataclass
class TestDevice:
    """One SSH device of an `ssh_lab`: an sshd in its own netns, reachable from the host."""

    __test__ = False  # a helper that tests import, not a test class for pytest to collect

    name: str  # dev-<lab>-<index>
    netns: str
    address: str  # the device's address in its netns, reachable from the host
    host_address: str  # the host's end of the link
    port: int  # sshd's port
    user: str  # the device's own user; for a root device a uid-0 alias of root
    home: Path  # the user's home (for a root device's alias: a fresh directory)
    key_path: Path  # ed25519 private key (mode 0600) that logs in as `user`
    known_hosts: Path  # the device's host key for "[address]:port"
    host_veth: str  # the host's end of the veth pair, which link_down() takes down

    def run(self, script: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """Run a sh script on the device as its user, in its netns, without going through SSH.

        Assertions must not depend on the link or sshd the test is exercising. The working
        directory is `home`; HOME and PATH are what an SSH session gets. Output goes to files,
        not pipes, so a script may leave background processes behind without blocking here.
        """
        argv = ["ip", "netns", "exec", self.netns, _runuser(), "-u", self.user, "--"]
        argv += ["/bin/sh", "-c", script]
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            done = subprocess.run(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                cwd=self.home,
                env=_session_env(self.user),
                timeout=timeout,
                check=False,
            )
            out.seek(0)
            err.seek(0)
            return subprocess.CompletedProcess(
                argv,
                done.returncode,
                out.read().decode(errors="replace"),
                err.read().decode(errors="replace"),
            )

    def link_down(self) -> None:
        """Cut the device off the network; it and its processes keep running."""
        subprocess.run(["ip", "link", "set", self.host_veth, "down"], check=True)

    def link_up(self) -> None:
        subprocess.run(["ip", "link", "set", self.host_veth, "up"], check=True)

    def pids(self, pattern: str) -> list[int]:
        """Live processes of the device user, inside the device's netns, whose command line
        (arguments joined with spaces) contains `pattern`. The netns filter keeps a root
        device from matching the host's own processes."""
        uid = pwd.getpwnam(self.user).pw_uid
        inode = _netns_inode(self.netns)
        if inode is None:  # the lab is gone
            return []
        procs = _processes(inode)
        return [p.pid for p in procs if p.uid == uid and not p.zombie and pattern in p.cmdline]


@dataclass
class _Proc:
    pid: int
    ppid: int
    uid: int
    netns: int  # 0 when unknown: a zombie has no namespaces left
    zombie: bool
    cmdline: str


def _processes(netns_inode: int | None = None) -> Iterator[_Proc]:
    """All processes, or those in the network namespace with inode `netns_inode`."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            status = Path(entry.path, "status").read_text()
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            try:
                netns = Path(entry.path, "ns", "net").stat().st_ino
            except OSError:
                netns = 0
            raw = Path(entry.path, "cmdline").read_bytes()
        except OSError:
            continue  # exited while we looked
        if netns_inode is not None and netns != netns_inode:
            continue
        yield _Proc(
            pid=int(entry.name),
            ppid=int(fields["PPid"]),
            uid=int(fields["Uid"].split()[0]),
            netns=netns,
            zombie=fields.get("State", "").strip().startswith(("Z", "X")),
            cmdline=raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace"),
        )


def _netns_inode(netns: str) -> int | None:
    try:
        return Path("/run/netns", netns).stat().st_ino
    except FileNotFoundError:
        return None


def _session_env(user: str) -> dict[str, str]:
    """The environment an SSH session of `user` gets, not the test runner's (whose PATH may
    point into /root, which the device user cannot read)."""
    entry = pwd.getpwnam(user)
    return {
        "PATH": _STD_PATH,
        "HOME": entry.pw_dir,
        "USER": user,
        "LOGNAME": user,
        "SHELL": "/bin/sh",
        "LANG": "C.UTF-8",
    }


def _runuser() -> str:
    """runuser's absolute path: `ip netns exec` searches the session PATH, which has no sbin."""
    return shutil.which("runuser") or "/usr/sbin/runuser"


def _retry_shadow_tool(argv: list[str], busy_codes: tuple[int, ...]) -> int:
    """Run useradd/userdel, retrying while another one (a parallel test run) holds the
    /etc/passwd lock (exit 10) or for the codes in `busy_codes`."""
    deadline = time.monotonic() + 30
    while True:
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode not in (10, *busy_codes) or time.monotonic() > deadline:
            return done.returncode
        time.sleep(0.2)


class _DeviceSetup:
    """What has been created for one device so far, so teardown undoes exactly that even when
    setup failed halfway (and never deletes a user or netns it did not create)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.user: str | None = None  # set once *we* created the user
        self.root = False  # the user is a uid-0 alias: never kill by uid, never remove a home
        self.netns: str | None = None
        self.veth: str | None = None
        self.sshd: subprocess.Popen[bytes] | None = None

    def close(self) -> None:
        problems = []
        survivors = self._kill_processes()
        if survivors:
            problems.append(f"processes still alive: {survivors}")
        if self.sshd is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.sshd.wait(timeout=5)
        if self.veth is not None:
            _ip("link", "del", self.veth)  # also removes the peer; fine if already gone
        if self.netns is not None:
            result = _ip("netns", "del", self.netns)
            if result.returncode != 0 and Path("/run/netns", self.netns).exists():
                problems.append(f"ip netns del {self.netns}: {result.stderr.strip()}")
        if self.user is not None and self.root:
            # uid 0 is always "in use": --force, and no --remove (the home is the test's)
            code = _retry_shadow_tool(["userdel", "--force", self.user], ())
            if code not in (0, 6):
                problems.append(f"userdel {self.user} exited {code}")
        elif self.user is not None:
            code = _retry_shadow_tool(["userdel", "--remove", self.user], busy_codes=(8,))
            if code == 8:  # "currently used by process": a zombie nobody reaped yet
                code = _retry_shadow_tool(["userdel", "--force", "--remove", self.user], ())
            # 6: no such user (someone removed it already); 12: home could not be removed
            if code not in (0, 6, 12):
                problems.append(f"userdel {self.user} exited {code}")
        if problems:
            raise RuntimeError(f"ssh_lab teardown of {self.name}: " + "; ".join(problems))

    def _kill_processes(self) -> list[int]:
        """SIGKILL everything of the device user and everything inside its netns, until none
        is left: processes detach (setsid, double fork) and fork while we kill.

        Leaves go first, so their parents (sshd, shells, runuser) are still alive to reap them
        instead of leaving zombies for init; after a second, or for a shell loop that forks
        new children as fast as we kill them, whatever is left goes at once.
        """
        uid = pwd.getpwnam(self.user).pw_uid if self.user and not self.root else None
        inode = _netns_inode(self.netns) if self.netns else None
        if uid is None and inode is None:
            return []
        start = time.monotonic()
        while True:
            if self.sshd is not None:
                self.sshd.poll()  # reap our own child
            alive: dict[int, _Proc] = {}
            for p in _processes():
                mine = (uid is not None and p.uid == uid) or (inode and p.netns == inode)
                if mine and not p.zombie:  # zombies are for their parent or init to reap
                    alive[p.pid] = p
            elapsed = time.monotonic() - start
            if not alive or elapsed > 15:
                return sorted(alive)
            parents = {p.ppid for p in alive.values()}
            leaves = [pid for pid in alive if pid not in parents]
            for pid in alive if elapsed > 1 or not leaves else leaves:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)


def _free_tag() -> str:
    """6 hex digits not used by any user, netns or interface: names derive from it."""
    existing_users = {entry.pw_name for entry in pwd.getpwall()}
    for _ in range(100):
        tag = uuid.uuid4().hex[:6]
        if (
            f"vkd-{tag}" not in existing_users
            and not Path("/run/netns", f"vkd-{tag}").exists()
            and not Path("/sys/class/net", f"vkd{tag}h").exists()
        ):
            return tag
    raise RuntimeError("no free device tag")  # pragma: no cover - 16M names


def _keygen(path: Path, comment: str) -> str:
    """A fresh ed25519 key pair at `path` (mode 0600) and `path.pub`; returns the public line."""
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True,
        capture_output=True,
    )
    path.chmod(0o600)
    return Path(f"{path}.pub").read_text().strip()


def _wait_for_sshd(setup: _DeviceSetup, address: str, port: int, log: Path) -> None:
    """Until sshd sends its banner to a connection from the host's side of the link, which
    proves the listener, the route and the veth all work."""
    deadline = time.monotonic() + 30
    last: Exception | None = None
    while time.monotonic() < deadline:
        assert setup.sshd is not None
        if setup.sshd.poll() is not None:
            raise RuntimeError(
                f"sshd of {setup.name} exited {setup.sshd.returncode}:\n"
                + log.read_text(errors="replace")[-3000:]
            )
        try:
            with socket.create_connection((address, port), timeout=2) as conn:
                if conn.recv(64).startswith(b"SSH-"):
                    return
        except OSError as e:
            last = e
        time.sleep(0.05)
    raise RuntimeError(
        f"sshd of {setup.name} not accepting on {address}:{port} ({last}):\n"
        + log.read_text(errors="replace")[-3000:]
    )


def _ensure_root_login_possible() -> None:
    """sshd without PAM refuses accounts whose password field starts with "!" (locked), even
    for public keys. Debian images ship root as "*", which is fine; fail clearly otherwise."""
    with contextlib.suppress(OSError):
        for line in Path("/etc/shadow").read_text().splitlines():
            if line.startswith("root:") and line.split(":")[1].startswith("!"):
                raise RuntimeError(
                    "root's account is locked in /etc/shadow ('!'), so sshd (UsePAM no) refuses "
                    "root logins; unlock it for key logins with `usermod -p '*' root`"
                )


@contextlib.contextmanager
def _ssh_device(
    name: str,
    workdir: Path,
    *,
    root: bool,
    routed_in: ipaddress.IPv4Network | None,
    containers: bool = False,
) -> Iterator[TestDevice]:
    tag = _free_tag()
    setup = _DeviceSetup(name)
    try:
        if root:
            _ensure_root_login_possible()
            # A uid-0 alias with its own home and /bin/sh: root as sshd sees it (signal requests
            # ignored), without root's real rc files, which may be slow or take locks (pyenv)
            # that a killed session leaves behind.
            user = f"vkr-{tag}"
            home = workdir / f"{name}-home"
            home.mkdir(mode=0o755)
            argv = ["useradd", "--non-unique", "--uid", "0", "--gid", "0", "--no-create-home"]
            argv += ["--home-dir", str(home), "--shell", "/bin/sh", "--password", "*"]
            argv += ["--comment", f"vkubelet test device {name} (root)", user]
        else:
            user = f"vkd-{tag}"
            skel = workdir / ".vkd-empty-skel"  # no .bashrc/.profile: every exec stays cheap
            skel.mkdir(exist_ok=True)
            argv = ["useradd", "--create-home", "--skel", str(skel), "--shell", "/bin/sh"]
            # "*", not useradd's locked "!": sshd without PAM refuses locked accounts.
            argv += ["--password", "*", "--comment", f"vkubelet test device {name}", user]
        code = _retry_shadow_tool(argv, busy_codes=())
        if code != 0:
            raise RuntimeError(f"useradd {user} exited {code}")
        setup.user, setup.root = user, root
        if not root:
            home = Path(pwd.getpwnam(user).pw_dir)
        sshd_dir = workdir / f"{name}-sshd" if root else home / ".vkd-sshd"
        sshd_dir.mkdir(mode=0o700)

        netns, veth, peer = f"vkd-{tag}", f"vkd{tag}h", f"vkd{tag}n"
        _must(_ip("netns", "add", netns))
        setup.netns = netns
        _must(_ip("link", "add", veth, "type", "veth", "peer", "name", peer))
        setup.veth = veth
        _must(_ip("link", "set", peer, "netns", netns))
        if routed_in is None:
            net = _claim_subnet(
                veth, range(251, 255), range(256), "10.251-254.x.y/30 subnet for a test device"
            )
        else:
            second = routed_in.network_address.packed[1]
            net = _claim_subnet(
                veth,
                range(second, second + 1),
                _ROUTED_THIRD,
                f"10.{second}.253-254.x/30 subnet of {routed_in} for a routed test device",
            )
        host_address, address = str(net[1]), str(net[2])
        _must(_ip("link", "set", veth, "up"))
        _must(_ip("-n", netns, "addr", "add", f"{address}/30", "dev", peer))
        _must(_ip("-n", netns, "link", "set", peer, "up"))
        _must(_ip("-n", netns, "link", "set", "lo", "up"))  # pods listen on the device's lo
        if routed_in is not None:
            # The device answers worker pods through the host, which forwards what arrives on
            # this link (and only this link: the machine's ip_forward stays as it is). The
            # host's route to the device is the link's own /30.
            _must(_ip("-n", netns, "route", "add", "default", "via", host_address))
            sysctl = ["sysctl", "-q", "-w", f"net.ipv4.conf.{veth}.forwarding=1"]
            subprocess.run(sysctl, check=True, capture_output=True)

        port = SSH_DEVICE_PORT
        host_public = _keygen(sshd_dir / "ssh_host_ed25519_key", f"{name} host key")
        key_path = workdir / f"{name}-id_ed25519"
        authorized_keys = sshd_dir / "authorized_keys"
        authorized_keys.write_text(_keygen(key_path, f"vkubelet-test@{name}") + "\n")
        known_hosts = workdir / f"{name}-known_hosts"
        host_key = " ".join(host_public.split()[:2])
        patterns = f"[{address}]:{port}" if port != 22 else f"{address},[{address}]:22"
        known_hosts.write_text(f"{patterns} {host_key}\n")
        config = sshd_dir / "sshd_config"
        config.write_text(
            f"""\
Port {port}
ListenAddress {address}
HostKey {sshd_dir / "ssh_host_ed25519_key"}
PidFile {sshd_dir / "sshd.pid"}
AuthorizedKeysFile {authorized_keys}
UsePAM no
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
PermitRootLogin {"prohibit-password" if root else "no"}
AllowUsers {user}
AllowTcpForwarding yes
MaxSessions 64
MaxStartups 100
StrictModes no
LogLevel VERBOSE
PrintMotd no
PrintLastLog no
UseDNS no
Subsystem sftp /usr/lib/openssh/sftp-server
"""
        )
        # sshd runs as root, as on a real device, and lets in only the device's user: an
        # unprivileged sshd cannot give a session a terminal (it aborts writing login records).
        # It reads authorized_keys as that user; the host key stays root's.
        if not root:
            sshd_dir.chmod(0o711)
            shutil.chown(authorized_keys, user, user)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # its privilege separation directory

        log = workdir / f"{name}-sshd.log"
        # `ip netns exec` remounts /sys for the netns, where a container runtime finds no
        # cgroups; nsenter enters the netns alone and keeps the host's mounts.
        argv = (
            ["nsenter", f"--net=/run/netns/{netns}"]
            if containers
            else ["ip", "netns", "exec", netns]
        )
        argv += [SSHD, "-D", "-e", "-f", str(config)]  # sshd re-execs itself: absolute path
        with log.open("ab") as log_file:
            setup.sshd = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=log_file,
                cwd="/",
                env=_session_env(user),
                start_new_session=True,  # the test runner's Ctrl-C is for the runner
            )
        _wait_for_sshd(setup, address, port, log)
        yield TestDevice(
            name=name,
            netns=netns,
            address=address,
            host_address=host_address,
            port=port,
            user=user,
            home=home,
            key_path=key_path,
            known_hosts=known_hosts,
            host_veth=veth,
        )
    finally:
        setup.close()


@contextlib.contextmanager
def ssh_lab(
    count: int,
    workdir: Path,
    *,
    root: bool = False,
    routed_in: str | None = None,
    containers: bool = False,
) -> Iterator[list[TestDevice]]:
    """`count` SSH devices, each an sshd in its own netns behind a veth, logged in to with a
    key and verified with a known_hosts file, as the SSH provider meets real boards.

    Each device runs as its own fresh user (`root=True`: as root, for providers that need it;
    `home` is then a fresh directory to use as the pod directory). Everything is removed on
    exit, also after a failed setup: processes of the user and of the netns, the veth, the
    netns, the user and its home. sshd logs to `workdir/<name>-sshd.log`. Needs root.

    `routed_in` (a /16 of 10/8, such as a dev cluster's `virtual_pod_cidr()`): each device
    takes its address from a /30 of the range's 10.x.253-254.0 and a default route to the host,
    whose end of the link forwards (`forwarding=1` on that link alone), so the pods of a
    cluster whose workers route that range to the host reach the devices and get answers.

    `containers=True` (with `root=True`): the devices can run podman (the host's, with its
    storage: load images with `podman_load`; give their inventory `PODMAN_SETTINGS`) or docker
    (a daemon of each device's own from `docker_daemon`, whose `settings()` the inventory takes).
    """
    if count < 1:
        raise ValueError(f"count must be at least 1, not {count}")
    network = None if routed_in is None else ipaddress.IPv4Network(routed_in)
    if network is not None and (network.prefixlen != 16 or network.network_address.packed[0] != 10):
        raise ValueError(f"routed_in must be a /16 of 10.0.0.0/8, not {routed_in}")
    workdir.mkdir(parents=True, exist_ok=True)
    lab = uuid.uuid4().hex[:6]
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(
                _ssh_device(
                    f"dev-{lab}-{i}",
                    workdir,
                    root=root,
                    routed_in=network,
                    containers=containers,
                )
            )
            for i in range(count)
        ]


#: How the lab's devices call Debian's podman (see docs/ssh-devices.md): its default runtime, crun,
#: refuses this host's hybrid cgroups, and its default rlimits exceed what the host allows.
PODMAN_SETTINGS: dict[str, Any] = {
    "containerRuntime": "podman",
    # The network config dir is the lab's own: podman writes its lock there (even for
    # `--network host`), and /etc/cni/net.d belongs to the worker nodes' CNI, whose tests check
    # that nothing appears in it while they run.
    "runtimeCommand": [
        "podman",
        "--runtime",
        "/usr/sbin/runc",
        "--network-config-dir",
        "/run/vkubelet-lab/podman-networks",
    ],
    "runtimeRunArgs": ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=4096:4096"],
}


def podman_unavailable() -> str | None:
    """Why lab devices cannot run podman here (a pytest skip reason), or None."""
    for tool in ("podman", "/usr/sbin/runc", "nsenter"):
        if shutil.which(tool) is None:
            return f"containers on lab devices need `{tool}` (apt-get install podman runc)"
    return None


def podman_load(archive: Path) -> str:
    """Load an OCI archive (a dev cluster image) into the host's podman storage, which the
    lab's devices share; returns the image reference podman gives it."""
    done = subprocess.run(
        ["podman", *PODMAN_SETTINGS["runtimeCommand"][1:], "load", "-q", "-i", str(archive)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0:
        raise RuntimeError(f"podman load {archive}: {done.stderr.strip()}")
    return done.stdout.strip().removeprefix("Loaded image: ").removeprefix("Loaded image(s): ")


#: Debian's docker (docker.io): its daemon and the CLI of the same build, by absolute path (a
#: machine may have another docker CLI earlier on PATH, such as a stand-alone client).
DOCKERD = "/usr/sbin/dockerd"
DOCKER = "/usr/bin/docker"


def docker_unavailable() -> str | None:
    """Why lab devices cannot run docker here (a pytest skip reason), or None."""
    for tool in (DOCKERD, DOCKER, "/usr/sbin/runc"):
        if not Path(tool).is_file():
            return f"docker on lab devices needs {tool}: apt-get install docker.io"
    if shutil.which("nsenter") is None:
        return "docker on lab devices needs `nsenter` (util-linux)"
    return None


@dataclass
class DockerDaemon:
    """A dockerd of one lab device (`docker_daemon`): its containers are the device's."""

    directory: Path  # data-root, exec-root, pid file, socket and log, all of this daemon's
    process: subprocess.Popen[bytes]
    cgroup: str  # the parent of its containers' cgroups, in each hierarchy

    @property
    def command(self) -> list[str]:
        """The docker CLI talking to this daemon: a device's `runtimeCommand`."""
        return [DOCKER, "--host", f"unix://{self.directory / 'docker.sock'}"]

    def settings(self) -> dict[str, Any]:
        """The device's inventory settings for containers of this daemon."""
        return {"containerRuntime": "docker", "runtimeCommand": self.command}

    def cli(self, *args: str, timeout: float = 60) -> str:
        """`docker ARGS` against this daemon, from the host; its stdout (raises on failure)."""
        done = subprocess.run(
            [*self.command, *args], capture_output=True, text=True, timeout=timeout, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def load(self, archive: Path) -> str:
        """Load an image archive (a dev cluster image) into this daemon; its reference."""
        out = self.cli("load", "-q", "-i", str(archive), timeout=120).strip()
        return out.removeprefix("Loaded image: ").removeprefix("Loaded image ID: ")


@contextlib.contextmanager
def docker_daemon(device: TestDevice, directory: Path) -> Iterator[DockerDaemon]:
    """A dockerd for `device` (a root device of a `containers=True` lab), in its network
    namespace, everything under `directory`: the device's containers with `--network host` are
    on the device's network. It changes nothing of the host's network (no bridge, no iptables
    rules, no forwarding); the hybrid cgroups and the host's rlimits suit Debian's docker with
    its default runc as they are. Its mounts and /run are its own, its containers' cgroups
    under a parent of its own: on exit its containers are removed, it is stopped and its
    cgroups removed, and nothing of it is left on the host but `directory` (and the trust key
    that Debian's dockerd 20.10 writes to /etc/docker/key.json once)."""
    directory.mkdir(parents=True)
    cgroup = f"vkubelet-lab-{device.netns}"
    # Its own mount namespace, whose /run is a directory of its own: what it mounts (layers,
    # its netns file) is gone with it, and containerd's shims, which put their sockets in
    # /run/containerd whatever the daemon's roots, leave nothing in the host's /run (where the
    # worker nodes' tests look for traces).
    run = directory / "run"
    run.mkdir()
    argv = ["nsenter", f"--net=/run/netns/{device.netns}"]
    argv += ["unshare", "--mount", "--propagation", "private"]
    argv += ["sh", "-c", 'mount --bind "$0" /run && exec "$@"', str(run), DOCKERD]
    # The exec root holds containerd's sockets (`containerd.sock.ttrpc`): inside the daemon's
    # /run, since below a pytest-xdist worker's directory they passed the 107-byte limit of a
    # socket path and containerd never started (CI: "timeout waiting for containerd").
    argv += ["--data-root", str(directory / "data"), "--exec-root", "/run/docker"]
    argv += ["--pidfile", str(directory / "dockerd.pid")]
    argv += ["--host", f"unix://{directory / 'docker.sock'}"]
    argv += ["--iptables=false", "--ip6tables=false", "--ip-forward=false", "--ip-masq=false"]
    argv += ["--bridge=none", "--cgroup-parent", f"/{cgroup}"]
    log = directory / "dockerd.log"
    with log.open("ab") as log_file:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
            cwd="/",
            start_new_session=True,
        )
    daemon = DockerDaemon(directory, process, cgroup)
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                tail = log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"dockerd of {device.name} exited {process.returncode}:\n{tail}")
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                daemon.cli("version", timeout=5)
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"dockerd of {device.name} did not answer within 60 s")
            time.sleep(0.05)
        yield daemon
    finally:
        _stop_docker(daemon)


def _stop_docker(daemon: DockerDaemon) -> None:
    """Remove the daemon's containers, stop it (its mounts go with its mount namespace), and
    remove its cgroups."""
    with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
        ids = daemon.cli("ps", "-aq", timeout=30).split()
        if ids:
            daemon.cli("rm", "-f", *ids, timeout=60)
    if daemon.process.poll() is None:
        daemon.process.terminate()
        try:
            daemon.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(daemon.process.pid, signal.SIGKILL)
            daemon.process.wait(timeout=10)
    for hierarchy in Path("/sys/fs/cgroup").iterdir():  # v1's, and v2's files are no directory
        for parent in (hierarchy / daemon.cgroup, Path("/sys/fs/cgroup") / daemon.cgroup):
            with contextlib.suppress(OSError):
                parent.rmdir()


def ssh_inventory(devices: list[TestDevice], **extra: Any) -> dict[str, Any]:
    """The SSH provider's inventory (for `yaml.safe_dump` to a `--provider-config` file) of
    `devices`: each labelled `lab.vkubelet.io/device=<name>`; `extra` adds keys to every device."""
    return {
        "devices": [
            {
                "name": d.name,
                "address": d.address,
                "port": d.port,
                "user": d.user,
                "identityFile": str(d.key_path),
                "knownHosts": str(d.known_hosts),
                "labels": {"lab.vkubelet.io/device": d.name},
                **extra,
            }
            for d in devices
        ]
    }


def ssh_lab_unavailable() -> str | None:
    """Why `ssh_lab` cannot run here (a pytest skip reason), or None when it can."""
    if os.geteuid() != 0:
        return "the SSH device lab needs root (network namespaces, users, sshd)"
    if not Path(SSHD).is_file():
        return f"the SSH device lab needs OpenSSH's server ({SSHD}): apt-get install openssh-server"
    for tool in ("ip", "runuser", "useradd", "userdel", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"the SSH device lab needs `{tool}` on PATH"
    return None


class SshDeviceFactory(Protocol):
    def __call__(
        self, count: int = 1, *, root: bool = False, routed_in: str | None = None
    ) -> list[TestDevice]: ...


@pytest.fixture
def ssh_devices(tmp_path: Path) -> Iterator[SshDeviceFactory]:
    """A factory of SSH devices (see `ssh_lab`) that are all removed when the test ends:

    def test_my_device(ssh_devices):
        [device] = ssh_devices()
        boards = ssh_devices(3, root=True)
        routed = ssh_devices(routed_in=worker_cluster.virtual_pod_cidr())
    """
    reason = ssh_lab_unavailable()
    if reason:
        pytest.skip(reason)
    labs = 0
    with contextlib.ExitStack() as stack:

        def make(
            count: int = 1, *, root: bool = False, routed_in: str | None = None
        ) -> list[TestDevice]:
            nonlocal labs
            labs += 1
            workdir = tmp_path / f"ssh-lab-{labs}"
            return stack.enter_context(ssh_lab(count, workdir, root=root, routed_in=routed_in))

        yield make
