"""The device's side of a pod, sans I/O: the POSIX sh scripts the agent sends and their outputs.

A device has no kubelet, only a POSIX sh, coreutils or busybox (`setsid`, `mkfifo`, `base64`,
`date`, `tail`) and awk. Each pod becomes a supervisor script, `run.sh`, started detached (own
session, stdin from /dev/null) so that it outlives the SSH session and the agent. It keeps
everything in files, so the agent can be restarted, or lose the device for a while, and read
the truth again with one sweep. Scripts reach the device as `sh -s` with the script on stdin:
pod fields never appear in an SSH command line (but `exec_command`'s argv, which must).

Every value that comes from a pod reaches the shell through `shlex.quote` or is checked first
against a safe alphabet (uids, container names). Environment values, which may be secrets, are
never in an argv: they are written to a 0600 file that the container's shell sources before it
execs the command.

On-device layout, under the root (`podDir`: absolute, or relative to $HOME):

    events                  one line per state change, "<uid> <container> <word>", appended in a
                            single write; the agent follows it with `tail -F` as a poke to sweep.
                            The container is "-" for the pod itself ("stopping", "done").
    pods/<uid>/pod.json     the agent's metadata, opaque bytes (0600)
    pods/<uid>/containers   the containers in plan order: "init <name>" or "main <name>" lines;
                            written last, so a pod is listed by sweeps once its files are whole
    pods/<uid>/env/<name>   0600, sourced by the container's shell: `cd` to its working directory
                            (relative ones start from fs/), then `export NAME='value'` lines
    pods/<uid>/run.sh       the supervisor (generated); pods/<uid>/supervisor.log its output
    pods/<uid>/supervisor.pid  "<pid> <boot id> <start time>": the supervisor is alive if that
                            very process runs (the boot id and the start time from /proc tell it
                            from a later process with the same pid; "-" where /proc lacks them)
    pods/<uid>/stop         exists once a stop was requested: nothing (re)starts any more
    pods/<uid>/done         the supervisor has finished: every container is done or stopped
                            (or, stopped, it had died: see `revive_pod_script`)
    pods/<uid>/fs/          the default working directory
    pods/<uid>/c/<name>/cmd       the container's start script (its argv, quoted; no env)
    pods/<uid>/c/<name>/state     one line, replaced atomically (tmp + mv):
                                    waiting <Reason> [<back-off seconds>]
                                    running <pid> <startedAt>
                                    terminated <exitCode> <startedAt> <finishedAt>
                                    terminated 128 <at> <at> StartError <message in base64>
                                  times are RFC 3339 UTC to the second; a process killed by
                                  signal N exited with 128+N; StartError: the runtime could not
                                  start the container's command (see ImageRun)
                                    terminated 137 <at> <at> ContainerStatusUnknown <msg in base64>
                                  a run lost with a supervisor that died (see `revive_pod_script`)
    pods/<uid>/c/<name>/last      the previous termination (lastState), same format
    pods/<uid>/c/<name>/restarts  the restart count
    pods/<uid>/c/<name>/pid       the running process's pid, which is its process group's id;
                                  removed when it has ended
    pods/<uid>/c/<name>/backoff   the pid of the `sleep` of a back-off in progress
    pods/<uid>/c/<name>/pull, rm  a runtime container's (see ImageRun): get its image before a
                                  run (exit 0: there; 1: pull failed; 2: absent, policy Never),
                                  remove what a killed `run` left
    pods/<uid>/c/<name>/started   a podman container's (see ImageRun): started by its `cmd`
                                  beside `run`, reports it running once the runtime has started it
    pods/<uid>/c/<name>/cpid      the podman container's process (`run --pidfile`), once created
    pods/<uid>/c/<name>/message   the runtime's words while waiting on an image or a creation
    pods/<uid>/c/<name>/cid       a runtime container's id (the runtime's `--cidfile`), which
                                  names its cgroup for usage samples; removed before each run
    pods/<uid>/c/<name>/<n>.log   the log of run n (n = the restart count when it started), in
                                  the CRI format (see `vkubelet.sdk.logs`); the current and
                                  previous run's
    pods/<uid>/c/<name>/out, err  the FIFOs from the process to its log stampers
    pods/<uid>/c/<name>/stdin     with `stdin: true`: the FIFO the process reads (opened
                                  read-write by it: no EOF when an attached writer leaves)
    pods/<uid>/c/<name>/tty.sh, pts, session, code, tty.out   with `tty: true` (see
                                  `_TTY_START`)
    pods/<uid>/e/<name>/pid       an ephemeral container's (`kubectl debug`) process, an SSH
                                  session of the agent: "<pid> <boot id> <start time>" like
                                  supervisor.pid; stopping and removing the pod end it
    pods/<uid>/e/<name>/rm        an ephemeral runtime container's: removes it

The supervisor reads VKUBELET_BACKOFF_BASE (10), VKUBELET_BACKOFF_MAX (300) and
VKUBELET_BACKOFF_RESET (600), in seconds, from its environment: the kubelet's rule
(`vkubelet.sdk.backoff`): the first restart is at once, the next waits BASE seconds, then twice
as long each time up to MAX, and a restart RESET seconds after the last one is at once. Containers
inherit its environment (the SSH session's), VKUBELET_POD_DIR, then their own env.

Containers get their own process group and session from `setsid` (util-linux, busybox); `set -m`
cannot stand in for it, since dash and busybox ash turn job control off without a terminal.
Without setsid a container shares the supervisor's group and only its main process is
signalled. When a container's main process ends, what is left of its group is killed, as a
runtime does with a container's cgroup.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from ...sdk.logs import parse_rfc3339

__all__ = [
    "ContainerPlan",
    "ContainerStatus",
    "ImageRun",
    "Mount",
    "PodPlan",
    "RemotePod",
    "Runtime",
    "cid_path",
    "exec_command",
    "log_path",
    "logs_script",
    "parse_sweep",
    "pod_word",
    "remove_pod_script",
    "restart_container_script",
    "revive_pod_script",
    "root_word",
    "runtime_exec_command",
    "runtime_name",
    "start_pod_script",
    "stdin_path",
    "stop_pod_script",
    "sweep_script",
]

_UID = re.compile(r"[a-z0-9][-a-z0-9]{0,62}")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_POLICIES = ("Always", "OnFailure", "Never")
_REASON = re.compile(r"[A-Za-z]+")
# An image reference as a runtime takes it: never an option (no leading "-"), no blanks.
_IMAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]*")


# -- plans ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Runtime:
    """A container runtime on the device and how to call it: `command` is its argv prefix,
    from the trusted inventory. podman's and docker's CLIs agree on what is used here but for
    `run` (see `_run_words`): `kind` says which one it is."""

    command: list[str]
    run_args: list[str] = field(default_factory=list)  # added to every `run`
    # podman's `run` writes the container process's pid (`--pidfile`), so the supervisor can
    # tell when the container has started and a start that failed; docker's cannot.
    kind: Literal["podman", "docker"] = "podman"

    def words(self) -> str:
        return " ".join(shlex.quote(word) for word in self.command)


@dataclass(frozen=True)
class Mount:
    """A bind mount: `source` is relative to the pod directory (a volume) or absolute (hostPath)."""

    source: str
    target: str
    read_only: bool = False


@dataclass(frozen=True)
class ImageRun:
    """How a container of an image runs on the device's runtime instead of as a host process."""

    runtime: Runtime
    image: str
    pull_policy: str  # Always | IfNotPresent | Never
    entrypoint: list[str] | None = None  # the container's `command`: replaces the image's
    mounts: list[Mount] = field(default_factory=list)
    memory_bytes: int | None = None
    cpus: str | None = None


@dataclass(frozen=True)
class ContainerPlan:
    """A container as the device runs it. Checked when made, so that a pod the device could not
    run faithfully (an env name sh cannot export, a NUL no argv can hold) fails with a message
    that names the container and the field rather than running differently."""

    name: str
    argv: list[str]  # command + args, non-empty
    env: dict[str, str]  # literal values (may contain secrets)
    working_dir: str | None  # None or "": the pod's fs/ directory; relative: from there
    stdin: bool = False  # its stdin is a FIFO that `kubectl attach -i` writes to
    tty: bool = False  # it runs in a terminal that `kubectl attach -t` reaches
    image: ImageRun | None = None  # set: a runtime container; argv is then its args

    def __post_init__(self) -> None:
        _check_container(self.name)
        if self.image is not None:
            self._check_image_run(self.image)
        elif not self.argv:
            raise ValueError(f"container {self.name}: no command to run")
        for i, arg in enumerate(self.argv):
            _check_text(arg, f"container {self.name}: command (word {i + 1} of command and args)")
        for name, value in self.env.items():
            _check_env(self.name, name, value)
        if self.working_dir is not None:
            _check_text(self.working_dir, f"container {self.name}: workingDir")

    def _check_image_run(self, run: ImageRun) -> None:
        """What the runtime's CLI could misread: an image that looks like an option, a value
        the env file (one `NAME=value` line each) cannot hold, a mount spec with its separator."""
        if not _IMAGE.fullmatch(run.image):
            raise ValueError(
                f"container {self.name}: image {run.image!r} is not an image reference"
            )
        if run.pull_policy not in ("Always", "IfNotPresent", "Never"):
            raise ValueError(f"container {self.name}: unknown imagePullPolicy {run.pull_policy!r}")
        for i, arg in enumerate(run.entrypoint or []):
            _check_text(arg, f"container {self.name}: command (word {i + 1})")
        if run.entrypoint and not run.entrypoint[0]:
            # docker reads an empty --entrypoint as "the image's": another program would run
            raise ValueError(f"container {self.name}: command: its first word is empty")
        for name, value in self.env.items():
            if "\n" in value or "\r" in value:
                raise ValueError(
                    f"container {self.name}: environment variable {name}: a value with a line "
                    "break cannot reach a runtime container (its env file has a line per variable)"
                )
        for mount in run.mounts:
            for part, what in ((mount.source, "volume path"), (mount.target, "mountPath")):
                if any(c in part for c in ":,\n\0") or not part:
                    raise ValueError(
                        f"container {self.name}: {what} {part!r} cannot be a runtime bind mount "
                        "(no ':', ',' or line breaks)"
                    )
            if not mount.target.startswith("/"):
                raise ValueError(
                    f"container {self.name}: mountPath {mount.target!r} must be absolute"
                )


@dataclass(frozen=True)
class PodPlan:
    uid: str
    restart_policy: str  # "Always" | "OnFailure" | "Never"
    init_containers: list[ContainerPlan]
    containers: list[ContainerPlan]
    metadata_json: bytes  # written to pod.json

    def __post_init__(self) -> None:
        _check_uid(self.uid)
        if self.restart_policy not in _POLICIES:
            raise ValueError(f"pod {self.uid}: unknown restartPolicy {self.restart_policy!r}")
        if not self.containers:
            raise ValueError(f"pod {self.uid}: no containers")
        names = [c.name for c in self.all_containers]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"pod {self.uid}: two containers are named {name}")

    @property
    def all_containers(self) -> list[ContainerPlan]:
        return [*self.init_containers, *self.containers]


def _check_text(text: str, what: str) -> None:
    """`what` names the field; the text itself never goes into the message: an env value or an
    argument (after `$(VAR)` expansion) may hold a Secret's value, and this message becomes the
    pod's status message and a Warning event."""
    if "\0" in text:
        raise ValueError(
            f"{what} contains a NUL character, which a device cannot pass to a process"
        )


def _check_env(container: str, name: str, value: str) -> None:
    if not _ENV_NAME.fullmatch(name):
        raise ValueError(
            f"container {container}: environment variable {name!r} cannot be set on a device: "
            "its name must be letters, digits and _, not starting with a digit"
        )
    _check_text(value, f"container {container}: environment variable {name}")


def _check_uid(uid: str) -> None:
    if not _UID.fullmatch(uid):
        raise ValueError(f"pod uid {uid!r} is not a Kubernetes UID")


def _check_container(name: str) -> None:
    if not _DNS_LABEL.fullmatch(name):
        raise ValueError(f"container name {name!r} is not a DNS-1123 label")


# -- statuses -------------------------------------------------------------------------------------
@dataclass
class ContainerStatus:
    name: str
    state: Literal["waiting", "running", "terminated"]
    # waiting: ContainerCreating | PodInitializing | CrashLoopBackOff | ErrImagePull | ...;
    # terminated: Completed | Error | StartError
    reason: str
    pid: int | None
    started_at: datetime | None  # UTC, aware
    finished_at: datetime | None
    exit_code: int | None  # killed by signal N: 128+N
    restart_count: int
    last: ContainerStatus | None = None  # the previous termination
    backoff_seconds: int | None = None  # waiting in CrashLoopBackOff: the back-off in force
    message: str | None = None  # waiting on an image, or a start that failed: the runtime's words


@dataclass
class RemotePod:
    uid: str
    supervisor_alive: bool
    stopping: bool
    metadata_json: bytes
    init_containers: list[ContainerStatus]  # in plan order
    containers: list[ContainerStatus]
    finished: bool = False  # the supervisor ended as it should (pods/<uid>/done)

    @property
    def supervisor_lost(self) -> bool:
        """The supervisor died before it finished (killed, an OOM kill, a reboot): nothing
        restarts the pod's containers, and a state file may still say "running" of a run that
        has ended. `revive_pod_script` puts that right."""
        return not self.supervisor_alive and not self.finished


# -- paths as shell words -------------------------------------------------------------------------
def root_word(root: str) -> str:
    """The root as one shell word; a relative root is relative to $HOME, expanded on the device."""
    if "\0" in root or "\n" in root:
        raise ValueError(f"pod directory {root!r} must be a single-line path")
    if root.startswith("/"):
        return shlex.quote(root.rstrip("/") or "/")
    for home in ("~", "$HOME", "${HOME}"):
        if root == home:
            root = ""
        root = root.removeprefix(home + "/")
    root = root.strip("/")
    return '"$HOME"/' + shlex.quote(root) if root else '"$HOME"'


def pod_word(root: str, uid: str) -> str:
    _check_uid(uid)
    return f"{root_word(root)}/pods/{uid}"


def log_path(root: str, uid: str, container: str, run: int) -> str:
    """The log of run `run` of a container, as a shell word (it may expand $HOME): to be used
    in a command line as it is, never quoted again."""
    _check_container(container)
    return f"{pod_word(root, uid)}/c/{container}/{int(run)}.log"


def stdin_path(root: str, uid: str, container: str) -> str:
    """The FIFO a `stdin: true` container reads, as a shell word like `log_path`'s."""
    _check_container(container)
    return f"{pod_word(root, uid)}/c/{container}/stdin"


def terminal_paths(root: str, uid: str, container: str) -> tuple[str, str, str]:
    """A `tty: true` container's terminal output (tty.out), the file naming its terminal (pts)
    and the one with the pid that leads the terminal's session (session), as shell words like
    `log_path`'s."""
    _check_container(container)
    directory = f"{pod_word(root, uid)}/c/{container}"
    return f"{directory}/tty.out", f"{directory}/pts", f"{directory}/session"


# -- shell building blocks ------------------------------------------------------------------------
def _heredoc(command: str, text: str) -> str:
    """`command` with `text` on its stdin, verbatim: the delimiter is quoted (no expansion) and
    is no line of the text. Through a here-document, no value is ever in an argv."""
    lines = set(text.split("\n"))
    delimiter = "VKUBELET_EOF"
    while delimiter in lines:
        delimiter += "_"
    body = text if text.endswith("\n") else text + "\n"
    return f"{command} <<'{delimiter}'\n{body}{delimiter}\n"


# Functions shared by the scripts: finding out whether the supervisor runs, signalling groups.
_HELPERS = r"""
# -- helpers ------------------------------------------------------------------------------------
BOOT=-
read -r BOOT 2>/dev/null </proc/sys/kernel/random/boot_id || BOOT=-

# is_pid WORD: a pid that is safe to signal as a group: not empty, not 0 or 1 (which kill reads
# as "my own group" and "every process"), no leading zero.
is_pid() { case $1 in '' | 0* | 1 | *[!0-9]*) return 1 ;; esac; }

# signal_group SIG PID: SIG to the process group PID, or to PID alone if it leads no group (no
# setsid on this device). `kill -SIG -PID` is the one form dash, ash and bash all accept.
signal_group() {
	is_pid "$2" || return 1
	kill -"$1" -"$2" 2>/dev/null || kill -"$1" "$2" 2>/dev/null
}

# proc_start PID: sets PSTATE and START, PID's state and start time (ticks since boot) from
# /proc, "-" without it. With the boot id the start time tells a process from a later one that
# got the same pid; the state tells a zombie (which kill -0 finds) from a live process.
proc_start() {
	PSTATE=- START=-
	if read -r START 2>/dev/null <"/proc/$1/stat"; then
		set -- ${START##*)}
		PSTATE=${1:--} START=${20:--}
	fi
}

# own_session PID: wait (2 s at most) until PID leads a session of its own, i.e. setsid has run
# in it. Until then it is in this SSH session's process group, and whatever ends that group
# when the session closes would end the supervisor too. Without /proc: no wait.
own_session() {
	o_pid=$1 o_n=0
	while [ "$o_n" -lt 200 ] && read -r o_stat 2>/dev/null <"/proc/$o_pid/stat"; do
		set -- ${o_stat##*)}
		[ "$4" = "$o_pid" ] && return 0
		o_n=$((o_n + 1))
		sleep 0.01 2>/dev/null || sleep 1
	done
	return 0
}

# alive_as FILE: the process FILE names ("<pid> <boot id> <start time>") is that very process,
# still running (not a later one with its pid, nor a zombie). Sets APID.
alive_as() {
	read -r APID a_boot a_start 2>/dev/null <"$1" || return 1
	[ "$a_boot" = "$BOOT" ] && is_pid "$APID" && kill -0 "$APID" 2>/dev/null || return 1
	proc_start "$APID"
	[ "$START" = "$a_start" ] && [ "$PSTATE" != Z ]
}

# supervisor_alive POD_DIR: the pod's supervisor is the process that was started, still runs
# and has not finished. Sets SPID.
supervisor_alive() {
	[ ! -e "$1/done" ] || return 1
	alive_as "$1/supervisor.pid" || return 1
	SPID=$APID
}

SETSID=
if command -v setsid >/dev/null 2>&1; then SETSID=setsid; fi
"""

# A detached killer: after "$1" seconds, SIGKILL each group in the "FILE PID" pairs that follow
# if FILE (a container's pid file) still names it, i.e. the same run has not ended yet.
_KILLER = (
    'cd / && sleep "$1" && shift && while [ $# -ge 2 ]; do '
    'if read -r p rest 2>/dev/null <"$1" && [ "$p" = "$2" ]; then '
    'kill -KILL -"$p" 2>/dev/null || kill -KILL "$p" 2>/dev/null; fi; shift 2; done'
)


def _terminate(pid_files: str, grace_seconds: int) -> str:
    """TERM the groups of the containers whose pid files `pid_files` (a glob) finds, then KILL
    those still running after the grace period, from a detached process: the script returns
    at once, and works whoever runs it since these are plain kills of the user's processes.

    A pid file is a container's ("<pid>", removed when it ends) or an ephemeral container's
    ("<pid> <boot id> <start time>", left behind: it is signalled only if still that process)."""
    grace = max(0, int(grace_seconds))
    # Only the killer itself in the background: a backgrounded `a || b` is a subshell, which bash
    # keeps around (with this script's stdout, so the SSH channel would stay open) until b ends.
    kill_later = (
        "if [ $# -gt 0 ]; then\n"
        f"\t$SETSID sh -c {shlex.quote(_KILLER)} vkubelet-killer {grace} "
        '"$@" </dev/null >/dev/null 2>&1 &\n'
        "fi"
    )
    return (
        "set --\n"
        f"for f in {pid_files}; do\n"
        '\tif read -r p p_rest 2>/dev/null <"$f" && is_pid "$p" '
        '&& { [ -z "$p_rest" ] || alive_as "$f"; }; then\n'
        f'\t\tsignal_group {"TERM" if grace else "KILL"} "$p" && set -- "$@" "$f" "$p"\n'
        "\tfi\n"
        "done\n" + (kill_later + "\n" if grace else "")
    )


# -- start ----------------------------------------------------------------------------------------
def start_pod_script(root: str, plan: PodPlan) -> str:
    """Write the pod's files and start its supervisor, detached; print the supervisor's pid.

    Idempotent: a pod whose supervisor runs, has finished or is being stopped is left alone. A
    pod whose supervisor died (killed, or the device rebooted) starts over, its restart counts
    and logs kept; the containers it left running in this boot are killed first.
    """
    reason = "PodInitializing" if plan.init_containers else "ContainerCreating"
    names = [c.name for c in plan.all_containers]
    dirs = " ".join(f'"$P/c/{name}"' for name in names)
    metadata = base64.encodebytes(plan.metadata_json).decode()
    order = "".join(f"init {c.name}\n" for c in plan.init_containers) + "".join(
        f"main {c.name}\n" for c in plan.containers
    )
    parts = [
        f"# vkubelet: start pod {plan.uid}\n",
        "umask 077\n",
        'fail() { echo "vkubelet: cannot start the pod: $*" >&2; exit 1; }\n',
        f"R={root_word(root)}\n",
        f'mkdir -p "$R/pods/{plan.uid}" && P=$(cd "$R/pods/{plan.uid}" && pwd) '
        '|| fail "cannot create the pod directory"\n',
        _HELPERS,
        ': >>"$R/events" || fail "cannot write $R/events"\n',
        "\n# Started before: its supervisor runs, has finished, or the pod is being stopped.\n",
        'if supervisor_alive "$P" || [ -e "$P/done" ] || [ -e "$P/stop" ]; then\n',
        '\tread -r SPID rest 2>/dev/null <"$P/supervisor.pid" && echo "$SPID"\n',
        "\texit 0\n",
        "fi\n",
        _LOST,
        f'mkdir -p "$P/fs" "$P/env" {dirs} || fail "cannot create $P"\n',
        _heredoc('base64 -d >"$P/pod.json.tmp"', metadata),
        'mv -f "$P/pod.json.tmp" "$P/pod.json" || fail "cannot write pod.json"\n',
    ]
    for container in plan.all_containers:
        name = container.name
        parts += [
            _heredoc(f'cat >"$P/env/{name}"', _profile(container)),
            '[ -s "$P/env/' + name + '" ] || fail "cannot write env/' + name + '"\n',
            _heredoc(f'cat >"$P/c/{name}/cmd"', _container_script(plan.uid, container)),
            *(
                [_heredoc(f'cat >"$P/c/{name}/tty.sh"', _tty_script(plan.uid, container))]
                if container.tty
                else []
            ),
            *_image_files(plan.uid, container),
            f'd="$P/c/{name}"; rm -f "$d/pid" "$d/backoff"\n',
            '[ -s "$d/restarts" ] || echo 0 >"$d/restarts"\n',
            # a run that ended (or was lost) with an earlier supervisor: the new one goes on
            'read -r word rest 2>/dev/null <"$d/state" && [ "$word" = terminated ] || '
            f'{{ echo "waiting {reason}" >"$d/state.tmp" && mv -f "$d/state.tmp" "$d/state"; }} '
            f'|| fail "cannot write $d/state"\n',
        ]
    parts += [
        _heredoc('cat >"$P/run.sh"', _supervisor(plan)),
        _heredoc('cat >"$P/containers"', order),
        _LAUNCH,
    ]
    return "".join(parts)


# Of start_pod_script and revive_pod_script, with the helpers and P, the pod directory. An
# earlier supervisor is gone: its containers' runs are lost with it, as a kubelet's are when
# their shim dies. What it left in this boot is killed, its runtime containers removed (a new
# run never meets an old one), and a run it left "running" has ended: exit 137,
# ContainerStatusUnknown, the new supervisor restarts it or not by the pod's restartPolicy.
_LOST_MESSAGE = base64.b64encode(
    b"the pod's supervisor on the device had died: the container's run was ended"
).decode()
_LOST = f"""
# An earlier supervisor is gone: its runs are lost with it. Its shells (a subshell per
# container, waiting on it and restarting it) may live on in its group: they go first. A pid
# that no process has names that group still; one that another process got (another start
# time) no longer can, since a pid is not given out while a group has it.
lost=
if read -r o_pid o_boot o_start 2>/dev/null <"$P/supervisor.pid" && [ "$o_boot" = "$BOOT" ]; then
	lost=1
	proc_start "$o_pid"
	if is_pid "$o_pid" && {{ [ "$START" = - ] || [ "$START" = "$o_start" ]; }}; then
		kill -KILL -"$o_pid" 2>/dev/null
	fi
fi
for d in "$P"/c/*; do
	[ -d "$d" ] || continue
	if [ -n "$lost" ]; then
		if read -r p 2>/dev/null <"$d/pid"; then signal_group KILL "$p"; fi
		[ ! -f "$d/rm" ] || sh "$d/rm"
	fi
	rm -f "$d/pid" "$d/backoff"
	if read -r word pid at 2>/dev/null <"$d/state" && [ "$word" = running ]; then
		lost_at=$(date -u +%Y-%m-%dT%H:%M:%SZ)
		echo "terminated 137 $at $lost_at ContainerStatusUnknown {_LOST_MESSAGE}" >"$d/state.tmp" &&
			mv -f "$d/state.tmp" "$d/state"
	fi
done
"""

_LAUNCH = """
# The supervisor: in its own session, attached to nothing of this SSH session.
rm -f "$P/supervisor.pid"
$SETSID sh "$P/run.sh" "$P" </dev/null >>"$P/supervisor.log" 2>&1 &
SPID=$!
[ -z "$SETSID" ] || own_session "$SPID"
proc_start "$SPID"
echo "$SPID $BOOT $START" >"$P/supervisor.pid.tmp" &&
	mv -f "$P/supervisor.pid.tmp" "$P/supervisor.pid" || fail "no supervisor.pid"
echo "$SPID"
"""


def revive_pod_script(root: str, uid: str) -> str:
    """Start the pod's supervisor again if it died (see `RemotePod.supervisor_lost`), from the
    files it left, without the agent's plan (an adopted pod's env is only on the device): its
    lost runs end (`_LOST`), and it restarts them by the pod's restartPolicy. A stopped pod is
    not started again: it is done. Prints the new supervisor's pid, or nothing when there was
    nothing to do (alive, finished, or being started: no supervisor.pid yet)."""
    return (
        _pod_script(f"revive pod {uid}", root, uid)
        + 'fail() { echo "vkubelet: cannot restart the pod\'s supervisor: $*" >&2; exit 1; }\n'
        + '[ -f "$P/containers" ] && [ -f "$P/run.sh" ] && [ -f "$P/supervisor.pid" ] || exit 0\n'
        + 'if supervisor_alive "$P" || [ -e "$P/done" ]; then exit 0; fi\n'
        + _LOST
        + 'if [ -e "$P/stop" ]; then\n'
        + f'\t: >"$P/done" && echo "{uid} - done" >>"${{P%/pods/*}}/events"\n'
        + "\texit 0\nfi\n"
        + _LAUNCH
    )


def runtime_name(uid: str, container: str) -> str:
    """The runtime container's name: one per pod container, so that a new run replaces any
    earlier one (`--replace`) and a pod's container is never running twice."""
    _check_uid(uid)
    _check_container(container)
    return f"vk-{uid}-{container}"


def _image_files(uid: str, container: ContainerPlan) -> list[str]:
    """A runtime container's `pull` (run by the supervisor before each run: exit 0 when the
    image is there, 1 when pulling failed, 2 when it is absent under `Never`, 3 when the
    runtime itself is not there; the message on stdout and stderr) and `rm` (removes what a
    killed `run` left)."""
    run = container.image
    if run is None:
        return []
    rt = run.runtime.words()
    image = shlex.quote(run.image)
    present = f"{rt} image inspect {image} >/dev/null 2>&1"
    never = f"Container image {run.image} is not present with pull policy of Never"
    program = run.runtime.command[0]
    missing = (
        f"container runtime {program} is not on the device's PATH "
        "(containerRuntime, runtimeCommand in the inventory)"
    )
    check = (
        f"command -v {shlex.quote(program)} >/dev/null 2>&1 || "
        f"{{ echo {shlex.quote(missing)}; exit 3; }}\n"
    )
    pull = (
        check
        + {
            "Always": f"exec {rt} pull -q {image}",
            "IfNotPresent": f"{present} && exit 0\nexec {rt} pull -q {image}",
            "Never": f"{present} && exit 0\necho {shlex.quote(never)}\nexit 2",
        }[run.pull_policy]
    )
    d = f'"$P/c/{container.name}'
    started = []
    if run.runtime.kind == "podman":
        started = [_heredoc(f'cat >{d}/started"', _started_script(uid, container.name))]
    return [
        *started,
        _heredoc(f'cat >{d}/pull"', f"# vkubelet: image of container {container.name}\n{pull}\n"),
        _heredoc(f'cat >{d}/rm"', _rm_script(run.runtime, uid, container.name)),
    ]


def _rm_script(runtime: Runtime, uid: str, container: str) -> str:
    """Remove the runtime container of a pod's container: KILL first, since the grace period
    is over when this runs and `podman rm -f` would stop it with its own 10 s timeout."""
    rt, name = runtime.words(), runtime_name(uid, container)
    return f"{rt} kill {name} >/dev/null 2>&1\n{rt} rm -f {name} >/dev/null 2>&1\n"


def _started_script(uid: str, name: str) -> str:
    """Reports a podman container running once the runtime has started it, as a kubelet does
    (arguments: the container's directory, the pid of its `run`).

    `run` creates the container, then starts it: the runtime writes the pid of the container's
    process (`--pidfile`) once it has created it, and that process, the runtime's init until
    then (`runc:[2:INIT]`; crun, youki), becomes the container's command when it is started. So
    it is running once that process has another name. No runtime command runs for it (each
    costs a device ~50 ms of CPU): one read of /proc every 10 ms, then every 50 ms.
    """
    return f"""\
# vkubelet: report container {name} of pod {uid} running once its runtime has started it
d=$1
n=0
nap() {{
	n=$((n + 1))
	w=0.05
	[ "$n" -gt 20 ] || w=0.01
	sleep "$w" 2>/dev/null || sleep 1
}}
pid=
while [ -z "$pid" ]; do # podman's pid file has no line break: read fails, yet reads it
	read -r pid 2>/dev/null <"$d/cpid" || [ -n "$pid" ] || nap
done
while read -r comm 2>/dev/null <"/proc/$pid/comm"; do
	case $comm in
	runc:* | crun | crun:* | youki*) nap ;;
	*)
		echo "running $2 $(date -u +%Y-%m-%dT%H:%M:%SZ)" >"$d/state.started" &&
			mv -f "$d/state.started" "$d/state"
		echo "{uid} {name} running" >>"${{d%/pods/*}}/events"
		exit 0
		;;
	esac
done
"""


def _profile(container: ContainerPlan) -> str:
    """The env file: the working directory first, while no pod value can have replaced
    VKUBELET_POD_DIR, then the environment. A directory that is not there fails the run like a
    runtime's StartError (exit 128), its message in the log.

    A runtime container's is the runtime's `--env-file`: a `NAME=value` line each, literal."""
    if container.image is not None:
        lines = [f"{name}={value}" for name, value in container.env.items()]
        return "".join(line + "\n" for line in lines) or "# no environment\n"
    lines = [
        f"# vkubelet: working directory and environment of container {container.name} (secret)",
        'cd -- "$VKUBELET_POD_DIR/fs" || exit 128',
    ]
    if container.working_dir:
        lines.append(f"cd -- {shlex.quote(container.working_dir)} || exit 128")
    lines += [f"export {name}={shlex.quote(value)}" for name, value in container.env.items()]
    return "\n".join(lines) + "\n"


def _container_script(uid: str, container: ContainerPlan) -> str:
    """The script run.sh starts under setsid, with the log FIFOs as stdout and stderr. It
    records its pid (its group's id) and the running state before it becomes the command."""
    name = container.name
    argv = " ".join(shlex.quote(arg) for arg in container.argv)
    # Working directory and environment (which may replace any variable: only literals follow);
    # a runtime reads the env file itself, with the values as they are.
    profile = f'. "$P/env/{name}"\n'
    running = (
        'echo "running $$ $(date -u +%Y-%m-%dT%H:%M:%SZ)" >"$d/state.tmp" '
        '&& mv -f "$d/state.tmp" "$d/state"\n'
        f'echo "{uid} {name} running" >>"${{P%/pods/*}}/events"\n'
    )
    if container.image is not None:
        argv = _run_words(uid, container, container.image, _files_of_run(container.image))
        # the runtime refuses a cid file that is there; docker has no `run --replace`
        profile = 'rm -f "$d/cid"\n' + _replace_line(container.image.runtime, uid, name)
        if container.image.runtime.kind == "podman":
            # Running once podman has started it (see `started`), not before `run`.
            profile = ""
            running = (
                'rm -f "$d/cid" "$d/cpid"\nsh "$d/started" "$d" $$ </dev/null >/dev/null 2>&1 &\n'
            )
    stdin = ""
    if container.stdin or container.tty:
        # Opened read-write, the FIFO never blocks the start and never reads EOF when an
        # attached client leaves: stdin stays open, as with `stdin: true` on a kubelet (and a
        # terminal without stdin is not handed an end of file).
        stdin = '[ -p "$d/stdin" ] || mkfifo -m 600 "$d/stdin"\nexec 0<>"$d/stdin"\n'
    start = f"{profile}exec {argv}\n"
    if container.tty:
        start = _TTY_START.format(name=name)
    return f"""\
# vkubelet: container {name} of pod {uid}; argument 1 is the pod directory.
P=$1
d=$P/c/{name}
echo $$ >"$d/pid"
# A stop may have come since the supervisor looked: the stop scripts create stop (and removal
# deletes run.sh) before they read pid files, and this pid file is written before this check.
if [ -e "$P/stop" ] || [ ! -e "$P/run.sh" ]; then exit 143; fi
{running}umask 022
{stdin}{start}"""


# A `tty: true` container's start: its command runs in a terminal that `script` (util-linux, or
# busybox's) holds, a process of the container detached like any other, so the terminal outlives
# SSH sessions and the agent. `script` copies the FIFO stdin to the terminal and the terminal's
# output both to stdout (the log) and, unprocessed, to tty.out, which `kubectl attach -t` follows
# (the log stamper would hold back a prompt until its line ends). tty.sh records the terminal's
# name (pts), which a resize sets with `stty -F`, the pid leading the terminal's session
# (session: its processes count for `kubectl top`), and the command's exit code (code):
# busybox's script does not pass it on. TERM to the group reaches script, which ends the command.
_TTY_START = """\
if ! command -v script >/dev/null 2>&1; then
	echo "vkubelet: container {name} has tty: true: a terminal needs script" \
		"(util-linux or busybox) on the device" >&2
	exit 127
fi
rm -f "$d/code" "$d/pts"
[ -f "$d/tty.out" ] && [ "$(wc -c <"$d/tty.out")" -lt 1048576 ] || : >"$d/tty.out"
SHELL=/bin/sh script -q -f -a -c 'exec sh "$VKUBELET_POD_DIR/c/{name}/tty.sh"' "$d/tty.out"
s=$?
read -r c 2>/dev/null <"$d/code" && exit "$c"
exit "$s"
"""


def _tty_script(uid: str, container: ContainerPlan) -> str:
    """What runs in a `tty: true` container's terminal (see `_TTY_START`): the command, as
    `_container_script` would exec it."""
    name = container.name
    argv = " ".join(shlex.quote(arg) for arg in container.argv)
    profile = f'. "$P/env/{name}"\n'
    if container.image is not None:
        argv = _run_words(uid, container, container.image, _files_of_run(container.image))
        runtime = container.image.runtime
        profile = "" if runtime.kind == "podman" else 'rm -f "$d/cid"\n'
        profile += _replace_line(runtime, uid, name)
    return f"""\
# vkubelet: container {name} of pod {uid} in its terminal.
P=$VKUBELET_POD_DIR
d=$P/c/{name}
trap 'echo $? >"$d/code"' EXIT
echo $$ >"$d/session"
tty >"$d/pts.tmp" 2>/dev/null && mv -f "$d/pts.tmp" "$d/pts"
{profile}{argv}
"""


def _files_of_run(run: ImageRun) -> list[str]:
    """Where a container's `run` writes its id (for its cgroup) and, with podman, the pid of its
    process (for its start: see `_started_script`)."""
    files = ["--cidfile", '"$d/cid"']
    return [*files, "--pidfile", '"$d/cpid"'] if run.runtime.kind == "podman" else files


def _replace_line(runtime: Runtime, uid: str, container: str) -> str:
    """What makes room for a run named as an earlier one (a `run` killed before it could
    remove its container): podman's `run --replace` does it; docker has no such flag, so its
    `rm -f` runs first (nothing else starts this name: the supervisor runs one at a time)."""
    if runtime.kind != "docker":
        return ""
    return f"{runtime.words()} rm -f {runtime_name(uid, container)} >/dev/null 2>&1\n"


def _run_words(uid: str, container: ContainerPlan, run: ImageRun, extra: Sequence[str] = ()) -> str:
    """`<runtime> run` in the foreground, as shell words: its output goes to the log FIFOs, its
    exit code is the container's, and TERM to it reaches the container (the runtime proxies
    signals). The network is the device's, as for host processes: the pod IP is the device's
    and port-forward reaches 127.0.0.1. Values are quoted; `$P` expands to the pod directory.

    Where docker differs: no `--replace` (`_replace_line` stands in); `--entrypoint` is one
    program, not podman's JSON list, so the command's other words go before the args (docker
    drops the image's command when given an entrypoint, as podman does); and `--log-driver
    none`, since the supervisor keeps the logs and the daemon's copy would grow unbounded."""
    q = shlex.quote
    docker = run.runtime.kind == "docker"
    words = [run.runtime.words(), "run", "--rm"]
    if not docker:
        words.append("--replace")
    words += ["--name", runtime_name(uid, container.name)]
    words += [
        "--label",
        q(f"io.vkubelet.pod-uid={uid}"),
        "--label",
        q(f"io.vkubelet.container={container.name}"),
    ]
    words += ["--network", "host", "--env-file", f'"$P/env/{container.name}"']
    if container.stdin:
        words.append("-i")
    if container.tty:
        words.append("-t")
    if container.working_dir:
        words += ["--workdir", q(container.working_dir)]
    for mount in run.mounts:
        spec = f"{mount.target}{':ro' if mount.read_only else ''}"
        source = mount.source if mount.source.startswith("/") else f'"$P"/{q(mount.source)}'
        words += ["--volume", f"{source}:{q(spec)}"]
    if run.memory_bytes is not None:
        words += ["--memory", str(run.memory_bytes)]
    if run.cpus is not None:
        words += ["--cpus", q(run.cpus)]
    if docker:
        words += ["--log-driver", "none"]
    words += [q(arg) for arg in run.runtime.run_args]
    args = container.argv
    if run.entrypoint is not None and docker:
        words.append(q(f"--entrypoint={run.entrypoint[0]}"))
        args = [*run.entrypoint[1:], *args]
    elif run.entrypoint is not None:
        words += ["--entrypoint", q(json.dumps(run.entrypoint))]
    words += [*extra, "--", q(run.image), *(q(arg) for arg in args)]
    return " ".join(words)


def cid_path(root: str, uid: str, container: str) -> str:
    """Where a runtime container's id is, as a shell word (it may expand $HOME): to be used in
    a command line as it is, never quoted again."""
    _check_container(container)
    return f"{pod_word(root, uid)}/c/{container}/cid"


def _supervisor(plan: PodPlan) -> str:
    inits = " ".join(c.name for c in plan.init_containers)
    mains = " ".join(c.name for c in plan.containers)
    header = f"""\
#!/bin/sh
# vkubelet: supervisor of pod {plan.uid}, generated; argument 1 is the pod directory.
POD={plan.uid}
POLICY={plan.restart_policy}
INITS='{inits}'
MAINS='{mains}'
"""
    return header + _SUPERVISOR_BODY


_SUPERVISOR_BODY = r"""
# Like a kubelet: init containers one after the other, each until it succeeds (or, with
# restartPolicy Never, until it fails: the pod has failed), then every container in parallel,
# restarted as the policy says with the kubelet's back-off, until each is done or the pod is
# stopped. The truth is in files (see vkubelet/providers/ssh/_remote.py): the agent may come and go.
P=$1
EVENTS=${P%/pods/*}/events
BASE=${VKUBELET_BACKOFF_BASE:-10}
MAX=${VKUBELET_BACKOFF_MAX:-300}
RESET=${VKUBELET_BACKOFF_RESET:-600}
export VKUBELET_POD_DIR="$P"
cd "$P" || exit 1

# Each container gets its own process group (and session) from setsid, so that signalling the
# group reaches its children too. `set -m` would not do: dash and ash turn job control off
# without a terminal. Without setsid a container stays in this group and is signalled alone.
SETSID=
if command -v setsid >/dev/null 2>&1; then SETSID=setsid; fi

now() { date -u +%Y-%m-%dT%H:%M:%SZ; }

# set_state CTR WORD...: replace CTR's state at once (the agent reads it at any time), then
# poke the agent: a short line in one write is appended whole.
set_state() {
	s_dir=$P/c/$1
	shift
	echo "$*" >"$s_dir/state.tmp" && mv -f "$s_dir/state.tmp" "$s_dir/state"
	echo "$POD ${s_dir##*/} $1" >>"$EVENTS"
}

# stamp STREAM LOG: appends what comes on stdin to LOG in the CRI log format, one line
# "<time> <stream> F <line>" as soon as it comes. Both streams' stampers append to the same file,
# so each line must be one write: awk writes to the file (stdout may be unbuffered, see below)
# and flushes every line, and lines longer than 4000 bytes go in pieces tagged P (partial), as
# containerd does past 16 KiB. mawk waits for a full input buffer unless told -W interactive.
# An awk without strftime (checked once, here) is replaced by a slower shell loop.
AWK_OPTS=
case $(awk -W version 2>&1 </dev/null) in *mawk*) AWK_OPTS='-W interactive' ;; esac
year=$(TZ=UTC awk 'BEGIN { print strftime("%Y") }' </dev/null 2>/dev/null)
if [ "$year" -gt 1970 ] 2>/dev/null; then
	stamp() {
		export VKUBELET_LOG="$2" LC_ALL=C TZ=UTC
		exec awk $AWK_OPTS -v s="$1" '
			function put(tag, text) {
				print strftime("%Y-%m-%dT%H:%M:%SZ"), s, tag, text >>ENVIRON["VKUBELET_LOG"]
				fflush(ENVIRON["VKUBELET_LOG"])
			}
			{
				line = $0
				for (; length(line) > 4000; line = substr(line, 4001))
					put("P", substr(line, 1, 4000))
				put("F", line)
			}'
	}
else
	stamp() {
		while IFS= read -r line || [ -n "$line" ]; do
			printf '%s %s F %s\n' "$(now)" "$1" "$line" >>"$2"
			line=
		done
	}
fi

# failure LOG: the runtime's last words in LOG (its last stderr line, without podman's "Error: "),
# for a kubelet's message.
failure() {
	awk '$2 == "stderr" { sub(/^[^ ]* [^ ]* [^ ]* (Error: )?/, ""); m = $0 } END { print m }' \
		"$1" 2>/dev/null | head -c 1000
}

# run CTR: one run of CTR, until it has ended and its log is complete (the agent relies on
# "terminated" meaning that). Sets CODE, RAN (seconds it ran) and TERMINATED (its state); or,
# when the runtime could not create the container (podman's 125 before any process of it
# existed: a full disk, a bad mount), CREATED to nothing, its words in CTR's message file, the
# state left as it was: that was no run, and the next attempt does not count as a restart.
run() {
	d=$P/c/$1
	read -r n 2>/dev/null <"$d/restarts" || n=0
	if [ -e "$d/$n.log" ]; then # run n happened: this is a restart
		n=$((n + 1))
		echo "$n" >"$d/restarts.tmp" && mv -f "$d/restarts.tmp" "$d/restarts"
		rm -f "$d/$((n - 2)).log" # the current and the previous run's logs are kept
	fi
	# One FIFO per stream, read by a stamper that always consumes: the process never blocks.
	rm -f "$d/out" "$d/err"
	mkfifo "$d/out" "$d/err" || echo "vkubelet: mkfifo failed in $d" >&2
	true >>"$d/$n.log" # the log exists from the start: it marks run n as begun
	stamp stdout "$d/$n.log" <"$d/out" &
	o=$!
	stamp stderr "$d/$n.log" <"$d/err" &
	e=$!
	t0=$(date +%s)
	$SETSID sh "$d/cmd" "$P" </dev/null >"$d/out" 2>"$d/err" &
	cpid=$!
	wait "$cpid" 2>/dev/null # (no "Terminated" note in supervisor.log)
	CODE=$?
	finished=$(now)
	RAN=$(($(date +%s) - t0))
	# As with a container's cgroup, what the main process leaves behind goes with it; a runtime
	# container too, if its `run` was killed before it ended.
	kill -KILL -"$cpid" 2>/dev/null
	[ ! -f "$d/rm" ] || sh "$d/rm"
	rm -f "$d/pid"
	# Both stampers end at the end of their pipe. A process that left the group may hold it
	# open: they get 2 seconds, then the log is complete as far as anyone can tell.
	(sleep 2 && kill "$o" "$e") 2>/dev/null &
	w=$!
	wait "$o" "$e"
	{ kill "$w" && wait "$w"; } 2>/dev/null
	rm -f "$d/out" "$d/err"
	started=$finished
	word=
	if read -r word pid at 2>/dev/null <"$d/state" && [ "$word" = running ]; then started=$at; fi
	TERMINATED="terminated $CODE $started $finished"
	CREATED=1
	# A podman container that never got a process: the runtime could not create it (125) or
	# start its command (126 not executable, 127 not found), as its last words in the log say.
	if [ "$word" != running ] && [ -f "$d/started" ] && [ ! -s "$d/cpid" ] &&
		[ ! -e "$P/stop" ]; then
		case $CODE in
		125)
			CREATED=
			failure "$d/$n.log" >"$d/message.tmp" && mv -f "$d/message.tmp" "$d/message"
			rm -f "$d/$n.log"
			return
			;;
		126 | 127)
			TERMINATED="$TERMINATED StartError $(failure "$d/$n.log" | base64 | tr -d '\n')"
			TERMINATED="terminated 128 ${TERMINATED#terminated $CODE }"
			;;
		esac
	fi
	set_state "$1" $TERMINATED
}

# backoff CTR SECONDS: wait before a restart, unless the pod is stopped meanwhile (the stop
# scripts create stop, then kill the sleep named in the backoff file: one of the two is seen).
backoff() {
	sleep "$2" &
	echo $! >"$P/c/$1/backoff"
	[ ! -e "$P/stop" ] || kill $! 2>/dev/null
	wait $! 2>/dev/null
	rm -f "$P/c/$1/backoff"
}

# pull CTR: until CTR's image is on the device (a runtime container's `pull` script says so),
# like a kubelet: after each failed attempt ErrImagePull with the runtime's words, for half the
# back-off (2 s at most), then ImagePullBackOff until the next attempt; the back-off is BASE
# seconds doubling up to MAX. ErrImageNeverPull under `Never`. Fails if the pod is stopped.
pull() {
	p_dir=$P/c/$1
	[ -f "$p_dir/pull" ] || return 0
	p_delay=$BASE
	while [ ! -e "$P/stop" ]; do
		sh "$p_dir/pull" >"$p_dir/pulled" 2>&1
		p_code=$?
		if [ "$p_code" -eq 0 ]; then
			rm -f "$p_dir/message" "$p_dir/pulled"
			return 0
		fi
		tail -c 1000 "$p_dir/pulled" >"$p_dir/message.tmp" &&
			mv -f "$p_dir/message.tmp" "$p_dir/message"
		p_wait=$p_delay
		case $p_code in
		2) set_state "$1" waiting ErrImageNeverPull ;;
		3) set_state "$1" waiting CreateContainerError "$p_delay" ;; # no runtime: retried
		*)
			p_wait=$((p_delay / 2))
			[ "$p_wait" -le 2 ] || p_wait=2
			set_state "$1" waiting ErrImagePull
			backoff "$1" "$p_wait"
			p_wait=$((p_delay - p_wait))
			[ -e "$P/stop" ] || set_state "$1" waiting ImagePullBackOff
			;;
		esac
		backoff "$1" "$p_wait"
		p_delay=$((p_delay * 2))
		[ "$p_delay" -le "$MAX" ] || p_delay=$MAX
	done
	return 1
}

# supervise CTR POLICY: run CTR as POLICY says, backing off between runs like the kubelet (see
# vkubelet.sdk.backoff): the first restart at once, then after BASE seconds, doubling up to MAX;
# at once again when RESET seconds passed since the last restart. Until it is done or the pod is
# stopped. Returns the last exit code.
supervise() {
	delay=0     # the back-off in force: none before the first restart
	restarted=0 # when the last restart happened, in seconds since the epoch
	c_delay=$BASE # between attempts to create it, whatever the policy (it never ran)
	CODE=1
	# A run that ended under an earlier supervisor, which died (or was lost with it): as if it
	# had just ended here.
	resumed=
	if read -r word code rest 2>/dev/null <"$P/c/$1/state" && [ "$word" = terminated ]; then
		resumed=1 CODE=$code TERMINATED="terminated $code $rest"
	fi
	while [ ! -e "$P/stop" ]; do
		if [ -z "$resumed" ]; then
			pull "$1" || break
			run "$1"
			if [ -z "$CREATED" ]; then
				set_state "$1" waiting CreateContainerError "$c_delay"
				backoff "$1" "$c_delay"
				c_delay=$((c_delay * 2))
				[ "$c_delay" -le "$MAX" ] || c_delay=$MAX
				continue
			fi
		fi
		resumed=
		c_delay=$BASE
		case $2 in
		Never) break ;;
		OnFailure) [ "$CODE" -ne 0 ] || break ;;
		esac
		[ ! -e "$P/stop" ] || break
		[ $(($(date +%s) - restarted)) -lt "$RESET" ] || delay=0
		echo "$TERMINATED" >"$P/c/$1/last.tmp" && mv -f "$P/c/$1/last.tmp" "$P/c/$1/last"
		if [ "$delay" -gt 0 ]; then
			set_state "$1" waiting CrashLoopBackOff "$delay"
			backoff "$1" "$delay"
			delay=$((delay * 2))
		else
			delay=$BASE
		fi
		[ "$delay" -le "$MAX" ] || delay=$MAX
		restarted=$(date +%s)
	done
	return "$CODE"
}

finish() {
	: >"$P/done"
	echo "$POD - done" >>"$EVENTS"
	exit 0
}

init_policy=OnFailure
[ "$POLICY" != Never ] || init_policy=Never
for ctr in $INITS; do
	supervise "$ctr" "$init_policy" || finish # failed for good, or stopped
	[ ! -e "$P/stop" ] || finish
done
for ctr in $MAINS; do
	supervise "$ctr" "$POLICY" &
done
wait
finish
"""


# -- sweep ----------------------------------------------------------------------------------------
def sweep_script(root: str, uids: list[str] | None = None) -> str:
    """Print the state of every pod (or of `uids`) in one go, for `parse_sweep`.

    Only shell builtins run per container, and one base64 per pod: a sweep of many pods is
    cheap. The output is line-based and each pod's record ends with "end <uid>", so a record cut
    short (a dropped connection) is recognised and left out.
    """
    base = root_word(root)
    if uids is None:
        targets = f"{base}/pods/*"
    else:
        for uid in uids:
            _check_uid(uid)
        targets = " ".join(f"{base}/pods/{uid}" for uid in uids)
    return (
        "# vkubelet: status sweep\n"
        + _HELPERS
        + f"""
echo "vkubelet-sweep 1"
for P in {targets}; do
	[ -f "$P/containers" ] || continue # not started, or not completely
	uid=${{P##*/}}
	alive=0
	! supervisor_alive "$P" || alive=1
	stopping=0
	[ ! -e "$P/stop" ] || stopping=1
	done=0
	[ ! -e "$P/done" ] || done=1
	echo "pod $uid $alive $stopping $done"
	echo json
	base64 <"$P/pod.json" 2>/dev/null
	echo .
	while read -r kind name; do
		d=$P/c/$name
		restarts=0
		read -r restarts 2>/dev/null <"$d/restarts"
		echo "$kind $name $restarts"
		state=
		read -r state 2>/dev/null <"$d/state"
		echo "state $state"
		if read -r last 2>/dev/null <"$d/last"; then echo "last $last"; fi
		case $state in "waiting Err"* | "waiting ImagePull"* | "waiting CreateContainerError"*)
			[ ! -s "$d/message" ] || echo "message $(base64 <"$d/message" | tr -d '\\n')" ;;
		esac
	done <"$P/containers"
	echo "end $uid"
done
"""
    )


class _Malformed(ValueError):
    pass


def parse_sweep(output: str | bytes) -> dict[str, RemotePod]:
    """The pods of a sweep's output, by uid. Never raises: a record with anything unexpected in
    it, or cut short, is left out (the next sweep tells), and text between records is ignored."""
    data = output.encode(errors="surrogateescape") if isinstance(output, str) else output
    pods: dict[str, RemotePod] = {}
    record: list[str] | None = None
    for raw in data.split(b"\n"):
        try:
            line = raw.decode("ascii").rstrip("\r")
        except UnicodeDecodeError:
            record = None
            continue
        if line.startswith("pod "):
            record = [line]
        elif record is not None and line.startswith("end "):
            try:
                pod = _parse_record(record, line[4:])
            except (_Malformed, ValueError, IndexError, binascii.Error):
                pass
            else:
                pods[pod.uid] = pod
            record = None
        elif record is not None:
            record.append(line)
    return pods


def _parse_record(lines: list[str], end_uid: str) -> RemotePod:
    words = lines[0].split(" ")
    if len(words) not in (4, 5) or words[1] != end_uid or not _UID.fullmatch(end_uid):
        raise _Malformed("pod line")
    uid, alive, stopping = words[1], _flag(words[2]), _flag(words[3])
    finished = len(words) == 5 and _flag(words[4])
    if lines[1] != "json" or "." not in lines:
        raise _Malformed("json")
    dot = lines.index(".")
    metadata = base64.b64decode("".join(lines[2:dot]), validate=True)
    pod = RemotePod(uid, alive, stopping, metadata, [], [], finished)
    rest = lines[dot + 1 :]
    i = 0
    while i < len(rest):
        kind, name, restarts = _words(rest[i], 3)
        if kind not in ("init", "main") or not _DNS_LABEL.fullmatch(name):
            raise _Malformed("container line")
        state = rest[i + 1]
        if state != "state" and not state.startswith("state "):
            raise _Malformed("state line")
        status = _status(name, state[len("state ") :].split(), _count(restarts or "0"))
        i += 2
        if i < len(rest) and rest[i].startswith("last "):
            status.last = _status(name, rest[i][len("last ") :].split(), status.restart_count)
            if status.last.state != "terminated":
                raise _Malformed("last")
            i += 1
        if i < len(rest) and rest[i].startswith("message "):
            text = base64.b64decode(rest[i][len("message ") :], validate=True)
            status.message = text.decode(errors="replace").strip() or None
            i += 1
        (pod.init_containers if kind == "init" else pod.containers).append(status)
    return pod


def _words(line: str, count: int) -> list[str]:
    words = line.split(" ")
    if len(words) != count:
        raise _Malformed(line)
    return words


def _flag(word: str) -> bool:
    if word not in ("0", "1"):
        raise _Malformed(word)
    return word == "1"


def _count(word: str) -> int:
    if not word.isdigit() or not word.isascii():
        raise _Malformed(word)
    return int(word)


def _time(word: str) -> datetime:
    moment = parse_rfc3339(word)
    if moment is None:
        raise _Malformed(word)
    return moment


def _status(name: str, words: list[str], restarts: int) -> ContainerStatus:
    """A state line's words; no state file yet reads as a container being created."""
    if not words:
        words = ["waiting", "ContainerCreating"]
    match words:
        case ["waiting", reason, *seconds] if _REASON.fullmatch(reason) and len(seconds) < 2:
            status = ContainerStatus(name, "waiting", reason, None, None, None, None, restarts)
            status.backoff_seconds = _count(seconds[0]) if seconds else None
            return status
        case ["running", pid, started]:
            return ContainerStatus(
                name, "running", "", _count(pid), _time(started), None, None, restarts
            )
        case ["terminated", code, started, finished]:
            exit_code = _count(code)
            reason = "Completed" if exit_code == 0 else "Error"
            times = _time(started), _time(finished)
            return ContainerStatus(name, "terminated", reason, None, *times, exit_code, restarts)
        case ["terminated", code, started, finished, reason, message] if reason in (
            "StartError",  # the runtime could not start its command: its words
            "ContainerStatusUnknown",  # lost with a supervisor that died
        ):
            times = _time(started), _time(finished)
            status = ContainerStatus(
                name, "terminated", reason, None, *times, _count(code), restarts
            )
            text = base64.b64decode(message, validate=True).decode(errors="replace").strip()
            status.message = text or None
            return status
    raise _Malformed(" ".join(words))


# -- stopping ---------------------------------------------------------------------------------
def _pod_script(what: str, root: str, uid: str) -> str:
    """The head of a script about one pod: what it does, the helpers, and P, the pod directory."""
    return f"# vkubelet: {what}\n" + _HELPERS + f"\nP={pod_word(root, uid)}\n"


def stop_pod_script(root: str, uid: str, grace_seconds: int) -> str:
    """Stop the pod: no more (re)starts, TERM to every running container's process group, and
    to its ephemeral containers' (`kubectl debug`), KILL after `grace_seconds` to those still
    running. Returns at once; the supervisor then ends."""
    return (
        _pod_script(f"stop pod {uid}", root, uid)
        + """[ -d "$P" ] || exit 0
: >"$P/stop" || exit 1
# Back-offs end now (see backoff in run.sh), then the running containers.
for f in "$P"/c/*/backoff; do
	if read -r p 2>/dev/null <"$f" && is_pid "$p"; then kill "$p" 2>/dev/null; fi
done
"""
        + _terminate('"$P"/c/*/pid "$P"/e/*/pid', grace_seconds)
        + f'echo "{uid} - stopping" >>"${{P%/pods/*}}/events"\n'
    )


def restart_container_script(root: str, uid: str, container: str, grace_seconds: int) -> str:
    """End the container's current run (a failed liveness probe): TERM, KILL after the grace
    period. The supervisor then restarts it or not, as the restart policy says."""
    _check_container(container)
    return _pod_script(f"restart container {container} of pod {uid}", root, uid) + _terminate(
        f'"$P"/c/{container}/pid', grace_seconds
    )


def remove_pod_script(root: str, uid: str) -> str:
    """Kill whatever of the pod still runs, its ephemeral containers' processes and runtime
    containers included, and delete its directory, logs included."""
    return (
        _pod_script(f"remove pod {uid}", root, uid)
        + """[ -d "$P" ] || exit 0
# Nothing may start any more: containers check for stop and run.sh before they exec.
: >"$P/stop"
rm -f "$P/run.sh"
# The supervisor's group first (its shells, log stampers, back-off sleeps), so that nothing
# restarts, then the containers' own groups.
if supervisor_alive "$P"; then signal_group KILL "$SPID"; fi
for f in "$P"/c/*/pid; do
	if read -r p 2>/dev/null <"$f"; then signal_group KILL "$p"; fi
done
for f in "$P"/e/*/pid; do
	if alive_as "$f"; then signal_group KILL "$APID"; fi
done
for f in "$P"/c/*/rm "$P"/e/*/rm; do
	[ ! -f "$f" ] || sh "$f"
done
rm -rf "$P"
"""
    )


# -- exec and logs --------------------------------------------------------------------------------
def exec_command(root: str, uid: str, container: str, argv: list[str]) -> str:
    """A command line for an SSH exec channel (with or without a PTY): `argv` in the
    container's working directory and environment, as a container process would see them.

    The device user's login shell reads this line, so it must be a POSIX-like shell (sh, bash,
    dash, ash, zsh). The env file is sourced by a `sh -c` whose script is a constant of this
    pod; argv follows as its arguments, each one quoted.
    """
    _check_container(container)
    if not argv:
        raise ValueError("exec: no command")
    for arg in argv:
        _check_text(arg, "exec: command")
    script = (
        f'P={pod_word(root, uid)}; export VKUBELET_POD_DIR="$P"; '
        f'. "$P/env/{container}" && exec "$@"'
    )
    args = " ".join(shlex.quote(arg) for arg in argv)
    return f"exec sh -c {shlex.quote(script)} vkubelet-exec {args}"


def ephemeral_script(root: str, uid: str, container: ContainerPlan) -> str:
    """Write the files of ephemeral container `container` (`kubectl debug`), whose process is
    an SSH session of the agent (`ephemeral_command`): its env file and, for a runtime
    container, its `rm`; print `new`. Print `old` when they were written before: handed again
    after an agent restart, whatever is left of it is ended (the process, by the pid file
    `ephemeral_command` wrote; the runtime container, by its `rm`), never left running."""
    name = container.name
    _check_container(name)
    e = f'"$P/e/{name}'
    rm = []
    if container.image is not None:
        rm = [_heredoc(f'cat >{e}/rm"', _rm_script(container.image.runtime, uid, name))]
    return (
        _pod_script(f"ephemeral container {name} of pod {uid}", root, uid)
        + "umask 077\n"
        + f'[ -d "$P/env" ] || {{ echo "pod {uid} is not on this device" >&2; exit 1; }}\n'
        + f'if [ -e "$P/env/{name}" ]; then\n'
        + f'\tif alive_as {e}/pid"; then signal_group KILL "$APID"; fi\n'
        + f'\t[ ! -f {e}/rm" ] || sh {e}/rm"\n'
        + "\techo old\n\texit 0\nfi\n"
        + f'mkdir -p {e}" || exit 1\n'
        + "".join(rm)
        + _heredoc(f'cat >"$P/env/{name}.tmp"', _profile(container))
        + f'mv -f "$P/env/{name}.tmp" "$P/env/{name}" && echo new\n'
    )


# Run first by an ephemeral container's SSH session: its pid (the session's, which leads its
# process group), boot id and start time to e/<name>/pid, so that stopping or removing the pod,
# or an agent that restarted, can end it and only it; then nothing starts in a stopped pod.
_EPHEMERAL_HEAD = (
    "st() {{ S=-; read -r l 2>/dev/null </proc/$$/stat || return 0; "
    "set -- ${{l##*)}}; S=${{20:--}}; }}; "
    "st; B=-; read -r B 2>/dev/null </proc/sys/kernel/random/boot_id || B=-; "
    'e="$P/e/{name}"; echo "$$ $B $S" >"$e/pid.tmp" && mv -f "$e/pid.tmp" "$e/pid" || exit 126; '
    '[ ! -e "$P/stop" ] || exit 143; '
)


def ephemeral_command(
    root: str, uid: str, container: ContainerPlan, *, tty: bool, target: str | None
) -> str:
    """The SSH command line of an ephemeral container's process (`kubectl debug`; a PTY with
    `tty`), after `ephemeral_script`: a host process as `exec_command` runs one, or for an
    image `<runtime> run` in the foreground, its env from the file `ephemeral_script` wrote, in
    the process namespace of the runtime container `target` (`--target`) when given. Both
    record their pid first (see `_EPHEMERAL_HEAD`)."""
    name = container.name
    _check_container(name)
    head = f"P={pod_word(root, uid)}; " + _EPHEMERAL_HEAD.format(name=name)
    if container.image is None:
        for arg in container.argv:
            _check_text(arg, "exec: command")
        script = head + f'export VKUBELET_POD_DIR="$P"; . "$P/env/{name}" && exec "$@"'
        args = " ".join(shlex.quote(arg) for arg in container.argv)
        return f"exec sh -c {shlex.quote(script)} vkubelet-debug {args}"
    extra = ["-t"] if tty else []
    if target is not None:
        extra += ["--pid", shlex.quote(f"container:{runtime_name(uid, target)}")]
    replace = _replace_line(container.image.runtime, uid, name).replace("\n", "; ")
    return head + replace + "exec " + _run_words(uid, container, container.image, extra)


def runtime_exec_command(
    runtime: Runtime, uid: str, container: str, argv: list[str], *, stdin: bool, tty: bool
) -> str:
    """`exec_command` for a runtime container: `<runtime> exec` into it, which gives the
    container's own env and working directory; argv quoted."""
    if not argv:
        raise ValueError("exec: no command")
    for arg in argv:
        _check_text(arg, "exec: command")
    flags = (" -i" if stdin else "") + (" -t" if tty else "")
    args = " ".join(shlex.quote(arg) for arg in argv)
    return f"exec {runtime.words()} exec{flags} {runtime_name(uid, container)} {args}"


def logs_script(root: str, uid: str, container: str, *, previous: bool, follow: bool) -> str:
    """Print the log of the container's current run (or the one before), in the CRI format.

    With `follow`, new lines are printed as they come (`tail -F`, which also waits for a log not
    there yet) until the channel is closed: the caller closes it once the run has ended. Without
    a previous run, `previous` prints an error and exits 1.
    """
    _check_container(container)
    pod = pod_word(root, uid)
    show = 'exec tail -n +1 -F "$log" 2>/dev/null' if follow else 'cat "$log" 2>/dev/null || true'
    pick = (
        '[ "$n" -gt 0 ] || { echo "no previous run" >&2; exit 1; }\nn=$((n - 1))\n'
        if previous
        else ""
    )
    return f"""\
# vkubelet: log of container {container} of pod {uid}
d={pod}/c/{container}
n=0
read -r n 2>/dev/null <"$d/restarts" || n=0
{pick}log=$d/$n.log
{show}
"""
