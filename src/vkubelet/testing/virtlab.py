"""pytest plugin: libvirt "hosts" for the vm provider's libvirt runtime.

Each host is what a hypervisor in the field looks like from the agent: a machine of its own on a
network, with a libvirt daemon (`libvirtd` + `virtlogd`, Debian's 9.0, QEMU driver) and an sshd
that logs root in with a key the lab gives out, so `qemu+ssh://root@ADDR/system` reaches that
host's daemon and no other. Two hosts migrate domains to each other over the lab network, as two
hypervisors do. Needs root, iproute2, util-linux (nsenter, unshare), openssh-server and
Debian's `libvirt-daemon libvirt-daemon-driver-qemu libvirt-clients`. Not loaded by default: a
suite enables it with

    pytest_plugins = ["vkubelet.testing.virtlab"]

and then gets the `libvirt_hosts` fixture; `libvirt_lab` is the same as a context manager (for a
module-scoped fixture: a lab starts in ~1 s once libvirt's capabilities are cached).

How a host is made (each step is needed; the reasons are what was found on these machines):

- **Network**: a namespace per host, its veth on a lab bridge in a free 10.249.x.y/28 (the
  machine holds .1 of it, the hosts .2, .3, ...): the test process, the hosts and their QEMUs'
  migration streams all travel it.
- **Files**: the daemons run in a mount namespace of their own (and a UTS namespace: the
  host's name is its hostname) where `/etc/libvirt`, `/run/libvirt`, `/var/lib/libvirt`,
  `/var/cache/libvirt` and `/var/log/libvirt` are bind mounts of the host's own directory, so
  two daemons share nothing: sockets, pid files (`-p`, else both take `/run/libvirtd.pid`),
  domain definitions, logs and the capabilities cache. Debian's packages ship no `qemu.conf`
  or `libvirtd.conf`: the lab writes them.
- **No /dev/kvm**: `/dev` is a small tmpfs (null, zero, full, random, urandom, tty, ptmx and
  the machine's pts, shm, net/tun). This machine's KVM is a nested one that cannot boot stock
  guests; when libvirt sees a /dev/kvm that its probe found unusable it drops its cached
  capabilities and probes QEMU again on every lookup (~4 s a capabilities call, ~38 s a
  define). Hidden, libvirt offers `<domain type='qemu'>` (TCG) only, and caches it.
- `qemu.conf`: `user/group = "root"`, `security_driver = "none"`, `namespaces = []` (else a
  start fails with "Unable to move /dev/pts mount"), `cgroup_controllers = []` (the machine's
  v1 cgroups are shared by all hosts: libvirt names a domain's `machine/qemu-<id>-<name>`, and
  two hosts with the same name and id, as in a migration, would collide), `migration_host`
  = the host's address (else the target tells the source to send to its hostname).
  `libvirtd.conf`: a `host_uuid` of its own (all hosts read the same SMBIOS UUID, and libvirt
  refuses to migrate "to the same host"), logging to `/var/log/libvirt/libvirtd.log`.
- The QEMU driver looks up the user `libvirt-qemu` and the groups `kvm` and `libvirt-qemu` even
  when told to run as root: the lab creates them when missing (as `libvirt-daemon-system`
  would) and leaves them.
- **Capabilities cache**: the first start on a machine probes QEMU (~4.6 s); the lab keeps
  the result under the vkubelet cache (`libvirt-capabilities/`) and seeds each new host with
  it. libvirt checks the cache against QEMU's binary, its own version and the kernel, and
  probes again when any changed: a stale seed costs the probe, never a wrong answer.
- **SSH**: the host's sshd runs in its namespaces, so what a remote client runs there
  (`virt-ssh-helper`, which libvirt 9 prefers to `nc`) finds that host's daemon at the default
  socket: the URI needs no `socket=`. `qemu+ssh` runs the `ssh` binary, which cannot be given a
  known_hosts file: the URI says `no_verify=1`, ssh then adds the host to root's
  `~/.ssh/known_hosts`, and the lab removes those lines at teardown. `qemu+libssh` takes
  `known_hosts=` and verifies (`libssh_uri`).

Teardown destroys every domain, stops every process in the host's namespaces (daemons,
QEMUs, sshd), and removes the veths, namespaces, bridge and the lab's known_hosts lines; the
mount namespaces end with their last process. A run killed before its teardown leaves all that
behind: the next lab removes it when it starts (a host's netns names the pid that made it).

**Live migration without shared storage** between two hosts (what works here, 2026-11-29; see
`tests/integration/vm/test_virtlab.py`): `virDomainMigrateToURI3(target.ssh_uri, params,
LIVE | PEER2PEER | NON_SHARED_INC | PERSIST_DEST | UNDEFINE_SOURCE)` on a connection to the
source, or `virsh migrate --live --p2p --copy-storage-inc --persistent --undefinesource
--migrate-disks vda --xml dest.xml NAME TARGET_URI`.

- Peer to peer: the source's daemon connects to the target's itself, over the same qemu+ssh URI
  (it runs `ssh` in its namespaces: the key file must be readable there; the lab's is).
- The target's disk file must exist first: libvirt creates it only for a disk inside a storage
  pool ("Storage pool not found: no storage pool with matching target path" otherwise). The
  paths differ per host: `DEST_XML` (`VIR_DOMAIN_XML_MIGRATABLE` with the path replaced) and
  `MIGRATE_DISKS = ["vda"]`. `NON_SHARED_INC` with a fresh overlay of the same base copies the
  overlay alone (0.8 MiB); `NON_SHARED_DISK` copies the whole chain into it (24 MiB here).
- The data travels plain TCP, no TLS, from the source's QEMU to the target's `migration_host`:
  :49152 the memory stream, :49153 the disk's NBD server (libvirt's port range
  49152-49215); ssh carries the daemons' control only.
- Timings at load average 15-20 on 2 cores: lab of two up in ~1.4 s (+4.6 s the first time
  on a machine), define 0.005 s, start 0.35-0.55 s, guest agent 9-26 s after start, migration
  of a 128-256 MiB guest 5-10 s, libvirt's reported downtime 194-451 ms (the QEMU runtime's is
  8-14 ms; `migrateSetMaxDowntime(10)` did not lower it: the daemons' finish handshake over ssh
  is in it), destroy 1.5-1.8 s, lab teardown ~3.5 s. `qemu+ssh` connect ~0.5 s.
- `restart_libvirtd()` (SIGTERM, start again: ~0.6 s): running domains keep their QEMU;
  connections made before it fail ("Cannot write data: Broken pipe"), a new one sees them.
- A refused migration (here: no target disk) leaves the guest running and defined at the
  source, nothing at the target. The reason may not reach the caller: the target said
  "pre-creation of storage targets for incremental storage migration is not supported"
  (`NON_SHARED_INC`; with `NON_SHARED_DISK`: "Storage pool not found ...") and the source's
  daemon logged it, but the client once got only "End of file while reading data: Warning:
  Permanently added ... to the list of known hosts" (ssh's stderr as the p2p link closed).
- Checkpoints do not travel with a `NON_SHARED_INC` migration: no checkpoint at the target and
  no bitmap in its disk, so an incremental backup there fails ("Checkpoint 'c1' ... not
  found"): the first backup after a move must be a full one.
- Probed once, not in a test (a 128 MiB guest, load average ~27): managed save works
  (`managedSave` 2.2 s, state shut off/saved, `/var/lib/libvirt/qemu/save/<name>.save`;
  `create()` restores in 4.8 s, the agent answers 1.6 s later). The backup API works on
  qcow2 overlays: a push backup with a checkpoint (`backupBegin(<domainbackup> with a
  target file, <domaincheckpoint><name>c1</name>...)`, done in <1 s, 24 MiB full) and an
  incremental one since it (`<incremental>c1</incremental>`, 4.6 MiB after 4 MiB written);
  poll `jobInfo()` until `VIR_DOMAIN_JOB_NONE`. `qemuMonitorCommand` (HMP) passes through.
- libvirtd warns "getaddrinfo failed for '<hostname>'" (a host's name resolves nowhere):
  harmless, migration_host is an address.
"""

from __future__ import annotations

import contextlib
import grp
import importlib.util
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from xml.sax.saxutils import quoteattr

import pytest

from .._files import write_atomic
from ..devcluster._build import cache_root
from . import _claim_subnet, _ip, _must
from .sshlab import (
    _ensure_root_login_possible,
    _keygen,
    _netns_inode,
    _processes,
    _retry_shadow_tool,
)

LIBVIRTD = "/usr/sbin/libvirtd"
VIRTLOGD = "/usr/sbin/virtlogd"
SSHD = "/usr/sbin/sshd"
#: The daemons' directories, each a bind mount of a directory of the host's own.
_BOUND = {
    "etc": "/etc/libvirt",
    "run": "/run/libvirt",
    "lib": "/var/lib/libvirt",
    "cache": "/var/cache/libvirt",
    "log": "/var/log/libvirt",
}
#: What a host's /dev holds: no kvm (see the module's docstring).
_DEVICES = {
    "null": (1, 3),
    "zero": (1, 5),
    "full": (1, 7),
    "random": (1, 8),
    "urandom": (1, 9),
    "tty": (5, 0),
    "ptmx": (5, 2),
    "net/tun": (10, 200),
}
_CAPS = "qemu/capabilities"  # under /var/cache/libvirt

# Run by `unshare` inside the host's fresh mount and UTS namespaces: bind the host's own
# directories over libvirt's, give it a /dev without kvm, then stay as the namespaces' anchor,
# which the daemons and sshd join (`nsenter -t`). Paths arrive as arguments, never in the text.
_HOLDER = r"""
set -eu
root=$1; hostname "$2"; shift 2
for pair in "$@"; do mkdir -p "${pair#*=}"; mount --bind "$root/${pair%%=*}" "${pair#*=}"; done
dev=$root/dev
mkdir -p "$dev"
mount -t tmpfs -o mode=0755,nosuid tmpfs "$dev"
mkdir "$dev/net" "$dev/pts" "$dev/shm"
mknod -m 666 "$dev/null" c 1 3; mknod -m 666 "$dev/zero" c 1 5; mknod -m 666 "$dev/full" c 1 7
mknod -m 666 "$dev/random" c 1 8; mknod -m 666 "$dev/urandom" c 1 9
mknod -m 666 "$dev/tty" c 5 0; mknod -m 666 "$dev/ptmx" c 5 2; mknod -m 666 "$dev/net/tun" c 10 200
mount --bind /dev/pts "$dev/pts"
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$dev/shm"
mount --move "$dev" /dev
echo ready
exec sleep infinity
"""


@dataclass
class LibvirtHost:
    """One hypervisor of a `libvirt_lab`: a libvirt daemon and an sshd in their own netns."""

    name: str  # lvh-<lab>-<index>, also the host's hostname
    netns: str
    address: str  # on the lab bridge; sshd listens on :22
    dir: Path  # the host's own files: etc/ run/ lib/ cache/ log/ (the daemons'), images/, ssh/
    key_path: Path  # ed25519 private key (0600) that logs in as root
    known_hosts: Path  # the host key for `address` (for `libssh_uri`, or an ssh client)
    host_uuid: str  # libvirtd.conf's host_uuid: what `virsh sysinfo`/capabilities report
    anchor_pid: int  # the process holding the host's mount and UTS namespaces

    @property
    def socket(self) -> Path:
        """The daemon's read-write socket, as the machine sees it."""
        return self.dir / "run" / "libvirt-sock"

    @property
    def local_uri(self) -> str:
        """This host's daemon from the machine, through its socket (no network involved)."""
        return f"qemu:///system?socket={self.socket}"

    @property
    def ssh_uri(self) -> str:
        """This host's daemon over SSH as root, the way a remote agent reaches a hypervisor.
        `no_verify=1`: ssh (the binary) takes no known_hosts file from the URI."""
        return f"qemu+ssh://root@{self.address}/system?keyfile={self.key_path}&no_verify=1"

    @property
    def libssh_uri(self) -> str:
        """Over SSH with libvirt's libssh transport, which verifies the host key."""
        return (
            f"qemu+libssh://root@{self.address}/system?keyfile={self.key_path}"
            f"&known_hosts={self.known_hosts}&known_hosts_verify=normal&sshauth=privkey"
        )

    @property
    def images(self) -> Path:
        """Where the host keeps disks (the test's overlays): a directory only it uses."""
        return self.dir / "images"

    def virsh(
        self, *args: str, uri: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """`virsh -c <uri> ARGS` (default: `local_uri`); raises with virsh's message on failure
        unless `check=False`."""
        argv = ["virsh", "-q", "-c", uri or self.local_uri, *args]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
        return done

    def running(self) -> list[str]:
        """The names of the host's running domains (`virsh list --name`)."""
        return self.virsh("list", "--name").stdout.split()

    def run(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run a command on the host, in its namespaces (as its sshd's sessions do), without
        going through SSH: what a test asserts must not depend on what it exercises."""
        return subprocess.run(
            [*self._enter(), *argv], capture_output=True, text=True, timeout=timeout, check=False
        )

    def overlay(self, base: Path, name: str) -> Path:
        """A qcow2 overlay of `base` in `images/`, for a domain's disk."""
        self.images.mkdir(exist_ok=True)
        disk = self.images / f"{name}.qcow2"
        argv = ["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", str(base)]
        subprocess.run([*argv, str(disk)], check=True, capture_output=True, timeout=60)
        return disk

    def route_pods(self, cidr: str) -> None:
        """Route `cidr` (a vm node's podCIDR on this host) from the machine to this host, as
        every node of a cluster routes a hypervisor's pod range to it ("On several hosts" in
        docs/vm-provider.md). The route goes with the lab bridge."""
        _must(_ip("route", "replace", cidr, "via", self.address))

    def restart_libvirtd(self) -> None:
        """Stop the daemon (SIGTERM, as a package upgrade does) and start it again; running
        domains keep running, as with a real host's daemon restart."""
        pid_file = self.dir / "run" / "libvirtd.pid"
        pid = int(pid_file.read_text().strip())
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{pid}").exists() and _state(pid) != "Z":
            if time.monotonic() > deadline:
                raise RuntimeError(f"libvirtd of {self.name} (pid {pid}) did not stop in 30 s")
            time.sleep(0.05)
        self.socket.unlink(missing_ok=True)
        _start_daemon(self, LIBVIRTD)
        _wait_for_libvirtd(self)

    def _enter(self) -> list[str]:
        return ["nsenter", "-t", str(self.anchor_pid), "-m", "-u", "-n", "--"]


def guest_domain_xml(
    name: str,
    disk: Path,
    *,
    memory_mib: int = 256,
    console_log: Path | None = None,
    nic: bool = False,
) -> str:
    """A small TCG domain (q35) for the test guest (`vm_guest_image`): its disk on virtio, the
    serial console on a pty (`virsh console`; logged to `console_log` when given), the guest
    agent's virtio-serial channel; with `nic`, a virtio NIC on a tap libvirt makes on the host
    (no address: the guest's own to configure, as a site's DHCP would). `type='qemu'` always: a
    visible /dev/kvm makes libvirt offer kvm, which cannot boot stock guests here. No graphics
    element (libvirt 9.0 rejects `type='none'`)."""
    log = f"<log file={quoteattr(str(console_log))}/>" if console_log else ""
    interface = "<interface type='ethernet'><model type='virtio'/></interface>" if nic else ""
    return f"""<domain type='qemu'>
  <name>{_text(name)}</name>
  <memory unit='MiB'>{memory_mib}</memory>
  <vcpu>1</vcpu>
  <os><type arch='x86_64' machine='q35'>hvm</type></os>
  <devices>
    <emulator>/usr/bin/qemu-system-x86_64</emulator>
    <disk type='file' device='disk'>
      <driver name='qemu' type='qcow2'/>
      <source file={quoteattr(str(disk))}/>
      <target dev='vda' bus='virtio'/>
    </disk>
    <serial type='pty'>{log}</serial>
    <console type='pty'/>
    <channel type='unix'><target type='virtio' name='org.qemu.guest_agent.0'/></channel>
    {interface}<memballoon model='none'/>
  </devices>
</domain>
"""


def _text(value: str) -> str:
    return value.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _state(pid: int) -> str:
    try:
        status = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "X"
    return status.rsplit(")", 1)[1].split()[0]


def _ensure_libvirt_accounts() -> None:
    """The user and groups the QEMU driver looks up at start, even as root (see the docstring)."""
    for group in ("kvm", "libvirt-qemu"):
        with contextlib.suppress(KeyError):
            grp.getgrnam(group)
            continue
        code = _retry_shadow_tool(["groupadd", "--system", group], busy_codes=())
        if code not in (0, 9):  # 9: created meanwhile by a parallel run
            raise RuntimeError(f"groupadd {group} exited {code}")
    with contextlib.suppress(KeyError):
        pwd.getpwnam("libvirt-qemu")
        return
    argv = ["useradd", "--system", "--no-create-home", "--home-dir", "/var/lib/libvirt"]
    argv += ["--shell", "/usr/sbin/nologin", "--gid", "libvirt-qemu", "--groups", "kvm"]
    code = _retry_shadow_tool([*argv, "libvirt-qemu"], busy_codes=())
    if code not in (0, 9):
        raise RuntimeError(f"useradd libvirt-qemu exited {code}")


def _caps_cache() -> Path:
    return cache_root() / "libvirt-capabilities"


def _seed_capabilities(host_dir: Path) -> None:
    target = host_dir / "cache" / _CAPS
    target.mkdir(parents=True, exist_ok=True)
    for cached in _caps_cache().glob("*.xml"):
        shutil.copyfile(cached, target / cached.name)


def _keep_capabilities(host: LibvirtHost) -> None:
    """Copy what the host's daemon probed (or kept) to the lab's cache, for the next hosts."""
    _caps_cache().mkdir(parents=True, exist_ok=True)
    for probed in (host.dir / "cache" / _CAPS).glob("*.xml"):
        kept = _caps_cache() / probed.name
        data = probed.read_bytes()
        if not kept.exists() or kept.read_bytes() != data:
            write_atomic(kept, data)


def _write_config(host_dir: Path, address: str, host_uuid: str) -> None:
    etc = host_dir / "etc"
    (etc / "qemu.conf").write_text(
        f"""\
user = "root"
group = "root"
dynamic_ownership = 0
security_driver = "none"
namespaces = []
cgroup_controllers = []
migration_host = "{address}"
"""
    )
    (etc / "libvirtd.conf").write_text(
        f"""\
host_uuid = "{host_uuid}"
log_outputs = "3:file:/var/log/libvirt/libvirtd.log"
"""
    )
    (etc / "virtlogd.conf").write_text('log_outputs = "3:file:/var/log/libvirt/virtlogd.log"\n')


class _HostSetup:
    """What exists of one host so far, so teardown undoes exactly that after a failed setup."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.netns: str | None = None
        self.veth: str | None = None
        self.children: list[subprocess.Popen[bytes]] = []
        self.host: LibvirtHost | None = None

    def close(self) -> None:
        problems = []
        if self.host is not None:
            with contextlib.suppress(Exception):  # whatever is left is killed below
                for name in self.host.running():
                    self.host.virsh("destroy", name, check=False, timeout=30)
        survivors = self._kill_processes()
        if survivors:
            problems.append(f"processes still alive: {survivors}")
        if self.host is not None:
            _end_ssh_clients(self.host.address)
        if self.veth is not None:
            _ip("link", "del", self.veth)
        if self.netns is not None:
            result = _ip("netns", "del", self.netns)
            if result.returncode != 0 and Path("/run/netns", self.netns).exists():
                problems.append(f"ip netns del {self.netns}: {result.stderr.strip()}")
        if problems:
            raise RuntimeError(f"libvirt_lab teardown of {self.name}: " + "; ".join(problems))

    def _kill_processes(self) -> list[int]:
        """SIGTERM the namespaces' processes (QEMU flushes, daemons remove their sockets), then
        SIGKILL what is left after 5 s; returns what survived."""
        inode = _netns_inode(self.netns) if self.netns else None
        start = time.monotonic()
        signalled: set[int] = set()
        while True:
            for child in self.children:
                child.poll()  # reap our own
            alive = [p.pid for p in _processes(inode) if not p.zombie] if inode else []
            alive += [c.pid for c in self.children if c.returncode is None and c.pid not in alive]
            elapsed = time.monotonic() - start
            if not alive or elapsed > 15:
                return sorted(alive)
            for pid in alive:
                if pid not in signalled or elapsed > 5:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGTERM if elapsed <= 5 else signal.SIGKILL)
                    signalled.add(pid)
            time.sleep(0.05)


def _end_ssh_clients(address: str) -> None:
    """SIGTERM the machine's `ssh` processes still connected to a host that is gone.

    Its sshd's closing FIN sometimes never reached them (seen now and then under load, cause
    not found): the ssh client of a libvirt connection then waited for ever,
    and so did the binding closing that connection at the runner's exit. Ended, the client
    makes libvirt see the connection closed, as a reset would."""
    listing = subprocess.run(
        ["ss", "-tnpH", "state", "established", "dst", f"{address}:22"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    for pid in re.findall(r'\("ssh",pid=(\d+),', listing):
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGTERM)


def _start_daemon(host: LibvirtHost, binary: str) -> None:
    pid_file = f"/run/libvirt/{Path(binary).name}.pid"
    log = host.dir / "log" / f"{Path(binary).name}.stderr"
    with log.open("ab") as out:
        subprocess.Popen(
            [*host._enter(), binary, "-p", pid_file],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            cwd="/",
            start_new_session=True,
        )


def _wait_for_libvirtd(host: LibvirtHost, timeout: float = 60) -> None:
    """Until the daemon answers on its socket."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if host.socket.exists():
            done = host.virsh("version", check=False, timeout=30)
            if done.returncode == 0:
                return
            last = done.stderr.strip()
        time.sleep(0.05)
    log = host.dir / "log" / "libvirtd.log"
    tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
    raise RuntimeError(
        f"libvirtd of {host.name} not answering in {timeout:.0f} s ({last}):\n{tail}"
    )


def _wait_for_sshd(sshd: subprocess.Popen[bytes], address: str, log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if sshd.poll() is not None:
            raise RuntimeError(f"sshd on {address} exited: {log.read_text(errors='replace')}")
        with contextlib.suppress(OSError), socket.create_connection((address, 22), 2) as conn:
            if conn.recv(64).startswith(b"SSH-"):
                return
        time.sleep(0.05)
    raise RuntimeError(f"sshd on {address} not accepting: {log.read_text(errors='replace')}")


@contextlib.contextmanager
def _libvirt_host(
    name: str, root: Path, bridge: str, address: str, tag: str, machine: str, routes: list[str]
) -> Iterator[LibvirtHost]:
    setup = _HostSetup(name)
    try:
        host_dir = root / name
        for sub in (*_BOUND, "ssh", "images"):
            (host_dir / sub).mkdir(parents=True)
        host_uuid = str(uuid.uuid4())
        _write_config(host_dir, address, host_uuid)
        _seed_capabilities(host_dir)

        # the netns names the process that owns it: a killed run's are found and removed
        netns, veth, peer = f"vkl-{os.getpid():x}-{tag}", f"vkl{tag}h", f"vkl{tag}n"
        _must(_ip("netns", "add", netns))
        setup.netns = netns
        _must(_ip("link", "add", veth, "type", "veth", "peer", "name", peer))
        setup.veth = veth
        _must(_ip("link", "set", peer, "netns", netns))
        _must(_ip("link", "set", veth, "master", bridge, "up"))
        _must(_ip("-n", netns, "addr", "add", f"{address}/28", "dev", peer))
        _must(_ip("-n", netns, "link", "set", peer, "up"))
        _must(_ip("-n", netns, "link", "set", "lo", "up"))
        _hypervisor_settings(netns)
        for cidr in routes:  # what its VMs reach: through the machine
            _must(_ip("-n", netns, "route", "replace", cidr, "via", machine))

        argv = ["nsenter", f"--net=/run/netns/{netns}", "unshare", "--mount", "--uts"]
        argv += ["--propagation", "private", "--", "sh", "-c", _HOLDER, "holder"]
        argv += [str(host_dir), name, *(f"{sub}={path}" for sub, path in _BOUND.items())]
        anchor = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        setup.children.append(anchor)
        assert anchor.stdout is not None and anchor.stderr is not None
        if anchor.stdout.readline() != b"ready\n":
            anchor.wait(timeout=10)
            raise RuntimeError(f"namespaces of {name}: {anchor.stderr.read().decode().strip()}")
        anchor.stdout.close()
        anchor.stderr.close()

        keys = host_dir / "ssh"
        host_public = _keygen(keys / "host_key", f"{name} host key")
        key_path = keys / "id_ed25519"
        (keys / "authorized_keys").write_text(_keygen(key_path, f"vkubelet-test@{name}") + "\n")
        known_hosts = keys / "known_hosts"
        known_hosts.write_text(f"{address} {' '.join(host_public.split()[:2])}\n")
        host = LibvirtHost(
            name=name,
            netns=netns,
            address=address,
            dir=host_dir,
            key_path=key_path,
            known_hosts=known_hosts,
            host_uuid=host_uuid,
            anchor_pid=anchor.pid,
        )
        setup.host = host

        _start_daemon(host, VIRTLOGD)
        _start_daemon(host, LIBVIRTD)
        (keys / "sshd_config").write_text(
            f"""\
Port 22
ListenAddress {address}
HostKey {keys / "host_key"}
PidFile {keys / "sshd.pid"}
AuthorizedKeysFile {keys / "authorized_keys"}
UsePAM no
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
PermitRootLogin prohibit-password
AllowUsers root
StrictModes no
MaxSessions 64
MaxStartups 100
LogLevel VERBOSE
PrintMotd no
UseDNS no
"""
        )
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # its privilege separation directory
        log = keys / "sshd.log"
        with log.open("ab") as out:
            sshd = subprocess.Popen(
                [*host._enter(), SSHD, "-D", "-e", "-f", str(keys / "sshd_config")],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                cwd="/",
                start_new_session=True,
            )
        setup.children.append(sshd)
        _wait_for_sshd(sshd, address, log)
        _wait_for_libvirtd(host)
        yield host
    finally:
        setup.close()


_LAB_NETNS = re.compile(r"vkl-([0-9a-f]+)-([0-9a-f]{6})")


def _remove_abandoned_hosts() -> None:
    """Remove the hosts of runs that were killed before their teardown: their daemons and QEMUs
    would run for ever, and their bridges keep a /28 of the lab's range. A host's netns names
    the process that made it; its processes are killed, the netns deleted (its veth goes with
    it), and its bridge removed once no host is left on it."""
    run_netns = Path("/run/netns")
    for entry in run_netns.iterdir() if run_netns.is_dir() else ():
        found = _LAB_NETNS.fullmatch(entry.name)
        if found is None:
            continue
        try:
            os.kill(int(found.group(1), 16), 0)
            continue  # its owner is alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        master = Path(f"/sys/class/net/vkl{found.group(2)}h/master")
        bridge = master.resolve().name if master.exists() else None
        setup = _HostSetup(entry.name)
        setup.netns = entry.name
        with contextlib.suppress(RuntimeError):  # another run may be removing it too
            setup.close()
        if bridge is not None and not any(Path(f"/sys/class/net/{bridge}/brif").glob("*")):
            _ip("link", "del", bridge)


def _forget_host_keys(addresses: list[str]) -> None:
    """Remove what `ssh` (qemu+ssh with no_verify, from the machine or a host's daemon) added to
    root's known_hosts for the lab's addresses, and the backup ssh-keygen makes of it."""
    known = Path.home() / ".ssh" / "known_hosts"
    backup = known.with_name("known_hosts.old")
    had_backup = backup.exists()
    for address in addresses:
        if known.exists():
            subprocess.run(["ssh-keygen", "-R", address, "-f", str(known)], capture_output=True)
    if not had_backup:
        backup.unlink(missing_ok=True)


def _hypervisor_settings(netns: str) -> None:
    """What the libvirt runtime's pod network needs of a hypervisor host and libvirt does not
    set (`providers.vm._lvnet`): forwarding, and proxy ARP on the taps libvirt will make (a
    tap takes the `default` settings when it is made)."""
    enter = ["ip", "netns", "exec", netns, "sysctl", "-q", "-w"]
    for setting in ("net.ipv4.ip_forward=1", "net.ipv4.conf.default.proxy_arp=1"):
        subprocess.run([*enter, setting], check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def libvirt_lab(
    count: int, workdir: Path, *, routes: Sequence[str] = ()
) -> Iterator[list[LibvirtHost]]:
    """`count` libvirt hosts on one lab bridge (see the module's docstring), removed on exit,
    also after a failed setup. The hosts' files are under `workdir/<host name>/`; each
    daemon's log is its `log/libvirtd.log`, sshd's `ssh/sshd.log`. Needs root.

    Every host forwards and proxies ARP on its VMs' taps (what the libvirt runtime's network
    needs of a hypervisor). `routes`: ranges the hosts route to the machine (a dev cluster's
    pods and Services, say), which then forwards what arrives on the lab bridge; the other
    way, `LibvirtHost.route_pods` routes a vm node's pod range from the machine to its host.
    The machine's routes and forwarding go with the lab bridge."""
    if not 1 <= count <= 12:
        raise ValueError(f"count must be 1 to 12 (a /28 per lab), not {count}")
    workdir.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_hosts()
    _ensure_root_login_possible()  # the hosts' sshd logs root in
    _ensure_libvirt_accounts()
    lab = uuid.uuid4().hex[:5]
    bridge = f"vkl{lab}b"
    addresses: list[str] = []
    try:
        _must(_ip("link", "add", bridge, "type", "bridge"))
        net = _claim_subnet(
            bridge, range(249, 250), range(256), "10.249.x.y/28 for a libvirt lab", prefix=28
        )
        _must(_ip("link", "set", bridge, "up"))
        if routes:
            Path(f"/proc/sys/net/ipv4/conf/{bridge}/forwarding").write_text("1")
        addresses = [str(net[2 + i]) for i in range(count)]
        machine = str(net[1])
        with contextlib.ExitStack() as stack:
            hosts = [
                stack.enter_context(
                    _libvirt_host(
                        f"lvh-{lab}-{i}",
                        workdir,
                        bridge,
                        addresses[i],
                        f"{lab}{i:x}",
                        machine,
                        list(routes),
                    )
                )
                for i in range(count)
            ]
            _keep_capabilities(hosts[0])
            yield hosts
    finally:
        _ip("link", "del", bridge)
        _forget_host_keys(addresses)


def libvirt_lab_unavailable() -> str | None:
    """Why `libvirt_lab` cannot run here (a pytest skip reason), or None when it can."""
    if os.geteuid() != 0:
        return "the libvirt lab needs root (network and mount namespaces, daemons)"
    for binary, package in (
        (LIBVIRTD, "libvirt-daemon libvirt-daemon-driver-qemu"),
        (VIRTLOGD, "libvirt-daemon"),
        (SSHD, "openssh-server"),
    ):
        if not Path(binary).is_file():
            return f"the libvirt lab needs {binary}: apt-get install {package}"
    for tool in (
        "virsh",
        "ip",
        "nsenter",
        "unshare",
        "ssh-keygen",
        "qemu-img",
        "qemu-system-x86_64",
    ):
        if shutil.which(tool) is None:
            return f"the libvirt lab needs `{tool}` on PATH"
    if importlib.util.find_spec("libvirt") is None:
        return (
            "the libvirt runtime needs its Python binding: apt-get install libvirt-dev"
            " pkg-config, then pip install 'vkubelet[libvirt]'"
        )
    return None


class LibvirtHostFactory(Protocol):
    def __call__(self, count: int = 2) -> list[LibvirtHost]: ...


@pytest.fixture
def libvirt_hosts(tmp_path: Path) -> Iterator[LibvirtHostFactory]:
    """A factory of libvirt hosts (see `libvirt_lab`), all removed when the test ends:

    def test_migration(libvirt_hosts):
        source, target = libvirt_hosts(2)
    """
    reason = libvirt_lab_unavailable()
    if reason:
        pytest.skip(reason)
    labs = 0
    with contextlib.ExitStack() as stack:

        def make(count: int = 2) -> list[LibvirtHost]:
            nonlocal labs
            labs += 1
            return stack.enter_context(libvirt_lab(count, tmp_path / f"libvirt-lab-{labs}"))

        yield make
