"""What a device uses, sans I/O: the script that samples it and the reading of its output.

One sample is one SSH command (on the device's one connection) whatever the number of pods: the
device's `/proc/stat` (CPU time of the whole machine, its CPU count, its boot time),
`/proc/meminfo`, and one pass of awk over every process's `/proc/<pid>/stat` that sums CPU
time and resident memory per container. In command mode a container is its process group and
session (`_remote` starts each with `setsid`, so its pid leads both): a process counts for the
container whose pid is its session, its process group, or itself. A `tty: true` container's
command runs in its terminal's own session, whose leader's pid `_remote` keeps in a file: that
session counts for the container too. CPU time includes what the
group's reaped children used (`cutime`, `cstime`), so short-lived commands count too.

A runtime container's processes run under the runtime (conmon, a shim), outside the
supervisor's process groups, in a cgroup of their own: the same command reads that cgroup, as
the kubelet's cAdvisor does, so its figures are exact and include every process the container
ever ran (`exec` sessions too). Its id (the runtime's `--cidfile`) is found in the cgroup paths
of `/proc/<pid>/cgroup`, the runtime's way of naming its cgroups whatever the manager (podman's
`libpod-<id>`, docker's `docker-<id>.scope`); CPU is cgroup v1's `cpuacct.usage` or v2's
`cpu.stat` `usage_usec`, the working set usage less inactive file pages (`memory.stat`), as
cAdvisor reports it. No runtime command runs: `podman stats` would cost a process, the
runtime's lock and rounded figures on every scrape.

A `Reading` is what a sample says in the device's units turned into bytes and nanoseconds: the
node's figures and each container's by (pod uid, container name), from process groups and
cgroups alike; the provider turns a reading into the kubelet's formats (`vkubelet.sdk.stats`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ContainerReading", "Reading", "parse_sample", "sample_script"]

# Busy CPU time of the machine: user, nice, system, irq, softirq, steal (guest time is already
# in user); idle and iowait are not.
_NODE = r"""awk '
/^cpu / { printf "cpu %.0f\n", $2 + $3 + $4 + $7 + $8 + $9 }
/^cpu[0-9]/ { n++ }
/^btime / { printf "btime %.0f\n", $2 }
END { printf "cpus %d\n", n }' /proc/stat
awk '/^(MemTotal|MemAvailable|MemFree|Buffers|Cached):/ {
	sub(":", "", $1); printf "mem %s %.0f\n", $1, $2 }' /proc/meminfo
"""

# Fields of /proc/<pid>/stat after the command name (which may hold spaces and parentheses, so
# the line is cut after its last ") "): 1 state, 3 pgrp, 4 session, 12-15 utime, stime, cutime,
# cstime (ticks), 22 rss (pages).
_GROUPS = r"""cat /proc/[0-9]*/stat 2>/dev/null | awk -v want="$WANT" -v also="$ALSO" '
BEGIN {
	n = split(want, w, " "); for (i = 1; i <= n; i++) keep[w[i]] = 1
	n = split(also, w, " ")
	for (i = 1; i <= n; i++) {
		eq = index(w[i], "="); s = substr(w[i], 1, eq - 1)
		keep[s] = 1; to[s] = substr(w[i], eq + 1)
	}
}
{
	rest = $0
	if (!sub(/^.*\) /, "", rest) || split(rest, f, " ") < 22) next
	if (f[4] in keep) k = f[4]; else if (f[3] in keep) k = f[3]; else if ($1 in keep) k = $1
	else next
	if (k in to) k = to[k]
	ticks[k] += f[12] + f[13] + f[14] + f[15]
	pages[k] += f[22]
}
END { for (k in ticks) printf "group %s %.0f %.0f\n", k, ticks[k], pages[k] }'
"""

# The cgroups of runtime containers. CIDS is "KEY=ID ..." (ids checked to be hex): grep finds
# the lines of /proc/<pid>/cgroup that hold an id ("<file>:<hierarchy>:<controllers>:<path>"),
# the path is cut after the component that holds it (a container may nest cgroups), and each
# container's files are read from the hierarchy's mount under /sys/fs/cgroup: v1's cpuacct and
# memory where mounted, else v2's (its root, or /sys/fs/cgroup/unified on hybrid hosts).
_CGROUPS = r"""set --
for kv in $CIDS; do set -- "$@" -e "${kv#*=}"; done
grep -Hs -F "$@" /proc/[0-9]*/cgroup | awk -v cids="$CIDS" '
function first(file, name,   line, f, found) {
	found = ""
	while ((getline line < file) > 0) {
		split(line, f, " ")
		if (name == "" || f[1] == name) { found = (name == "" ? f[1] : f[2]); break }
	}
	close(file)
	return found
}
BEGIN {
	n = split(cids, kv, " ")
	for (i = 1; i <= n; i++) {
		eq = index(kv[i], "=")
		key[substr(kv[i], eq + 1)] = substr(kv[i], 1, eq - 1)
	}
	v2 = "/sys/fs/cgroup"
	if ((getline x < (v2 "/cgroup.controllers")) < 0) v2 = "/sys/fs/cgroup/unified"
}
{
	line = $0
	if (!sub(/^[^:]*:[0-9]+:/, "", line)) next
	c = index(line, ":"); ctrls = substr(line, 1, c - 1); path = substr(line, c + 1)
	for (id in key) {
		at = index(path, id)
		if (!at) continue
		rest = substr(path, at); slash = index(rest, "/")
		if (slash) path = substr(path, 1, at + slash - 2)
		k = key[id]; seen[k] = 1
		if (ctrls == "") unified[k] = v2 path
		m = split(ctrls, cs, ",")
		for (j = 1; j <= m; j++) {
			if (cs[j] == "cpuacct") cpu[k] = "/sys/fs/cgroup/" ctrls path
			if (cs[j] == "memory") mem[k] = "/sys/fs/cgroup/" ctrls path
		}
	}
}
END {
	for (k in seen) {
		ns = ""; used = ""; inactive = ""
		if (k in cpu) ns = first(cpu[k] "/cpuacct.usage", "")
		else if (k in unified) {
			us = first(unified[k] "/cpu.stat", "usage_usec")
			if (us != "") ns = us "000"
		}
		if (k in mem) {
			used = first(mem[k] "/memory.usage_in_bytes", "")
			inactive = first(mem[k] "/memory.stat", "total_inactive_file")
		} else if (k in unified) {
			used = first(unified[k] "/memory.current", "")
			inactive = first(unified[k] "/memory.stat", "inactive_file")
		}
		if (ns == "" || used == "") continue
		ws = used - inactive
		printf "cgroup %s %s %.0f\n", k, ns, (ws > 0 ? ws : 0)
	}
}'
"""


@dataclass(frozen=True)
class ContainerReading:
    cpu_ns: int  # cumulative as read (it may drop: see `vkubelet.sdk.stats.CpuCounters`)
    working_set: int  # bytes


@dataclass(frozen=True)
class Reading:
    cpu_ns: int  # the machine's busy CPU time since boot
    cpus: int  # online CPUs (0: unknown)
    memory: int  # MemTotal, bytes (0: unknown)
    available: int  # MemAvailable (or free + buffers + cached on old kernels), bytes
    booted: float  # epoch seconds (0: unknown)
    containers: dict[tuple[str, str], ContainerReading] = field(default_factory=dict)

    @property
    def working_set(self) -> int:
        return max(self.memory - self.available, 0)


def sample_script(
    pids: list[int],
    cidfiles: dict[int, str] | None = None,
    terminals: dict[int, str] | None = None,
) -> str:
    """The sample: the node, the process groups of the host containers whose pids are `pids`
    (and the terminal sessions whose leaders' pid files are `terminals`, by their container's
    pid), and the cgroups of the runtime containers whose id files are `cidfiles` (by the pid
    of their `<runtime> run`, which keys their reading). The files are shell words, used as
    they are."""
    want = " ".join(str(int(pid)) for pid in pids if int(pid) > 1)
    script = "# vkubelet: usage sample\necho vkubelet-usage 1\n" + _NODE
    if want:
        script += f"WANT='{want}'\nALSO=\n"
        for pid, path in sorted((terminals or {}).items()):
            script += (
                f"t=$(cat {path} 2>/dev/null) && case $t in ''|0*|*[!0-9]*) ;; "
                f'*) ALSO="$ALSO $t={int(pid)}" ;; esac\n'
            )
        script += _GROUPS
    if cidfiles:
        script += "CIDS=\n"
        for pid, path in sorted(cidfiles.items()):
            # An id that is not hex never reaches grep: a file there is no runtime's id file.
            script += (
                f"c=$(cat {path} 2>/dev/null) && case $c in ''|*[!0-9a-f]*) ;; "
                f'*) CIDS="$CIDS {int(pid)}=$c" ;; esac\n'
            )
        script += 'if [ -n "$CIDS" ]; then\n' + _CGROUPS + "fi\n"
    return script


def parse_sample(
    output: bytes,
    containers: dict[int, tuple[str, str]],
    *,
    ticks_per_second: int,
    page_size: int,
) -> Reading:
    """A sample's output as a `Reading`; `containers` maps the pids the script was given to
    (pod uid, container name). Lines it does not know are skipped; a sample without the node's
    CPU line (the device's /proc unreadable) raises ValueError."""
    cpu: int | None = None
    cpus = 0
    booted = 0.0
    memory: dict[str, int] = {}
    found: dict[tuple[str, str], ContainerReading] = {}
    tick_ns = 1_000_000_000 // max(ticks_per_second, 1)
    for line in output.decode(errors="replace").splitlines():
        words = line.split()
        if not words or not all(w.isdigit() for w in words[2:]):
            continue
        match words:
            case ["cpu", ticks] if ticks.isdigit():
                cpu = int(ticks) * tick_ns
            case ["cpus", count] if count.isdigit():
                cpus = int(count)
            case ["btime", seconds] if seconds.isdigit():
                booted = float(seconds)
            case ["mem", name, kib]:
                memory[name] = int(kib) * 1024
            case ["group", pid, ticks, pages] if pid.isdigit() and int(pid) in containers:
                found[containers[int(pid)]] = ContainerReading(
                    int(ticks) * tick_ns, int(pages) * page_size
                )
            case ["cgroup", pid, ns, working_set] if pid.isdigit() and int(pid) in containers:
                found[containers[int(pid)]] = ContainerReading(int(ns), int(working_set))
    if cpu is None:
        raise ValueError("the device's /proc/stat could not be read")
    available = memory.get("MemAvailable")
    if available is None:  # kernels before 3.14
        available = sum(memory.get(k, 0) for k in ("MemFree", "Buffers", "Cached"))
    return Reading(cpu, cpus, memory.get("MemTotal", 0), available, booted, found)
