"""The host install: the agent as a systemd service of a hypervisor host (docs/host-install.md).

`vkubelet host install --config FILE` checks the agent config, writes `vkubelet.service` and
`vkubelet-vms.slice`, then enables and (re)starts the service: one command. The unit is generated
rather than shipped so that its `ExecStart` names the `vkubelet` that was installed (a venv, pipx,
a package: wherever it is) and the config file given, quoted for systemd.

What the unit must get right for VMs, and why:
- `KillMode=process`: a stop or restart of the service signals the agent only. Its VMs are QEMU
  processes that must outlive it (the next start adopts them); the default `control-group` would
  kill every QEMU with the agent.
- The agent runs each QEMU in a scope of its own in `vkubelet-vms.slice` when it runs under
  systemd (`_machine`), so guest memory is not accounted to the agent's service, and the VMs
  are not in its control group at all (a `systemctl kill vkubelet` leaves them alone too).
- `TimeoutStopSec` above the agent's own bound (it exits within 10 s of SIGTERM, see
  `sdk.tasks.run_until_signalled`); `Restart=always`; logs on stderr, so in the journal.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from .._files import write_atomic
from ..node import ConfigError
from ..node._config import load_agent_config

UNIT = "vkubelet.service"
SLICE = "vkubelet-vms.slice"
SYSTEM_UNITS = Path("/etc/systemd/system")
SYSTEMD_RUNTIME = Path("/run/systemd/system")  # present when the host booted with systemd


def systemd_quote(word: str) -> str:
    """One word of an `ExecStart=` line, as systemd reads it back: `%` and `$` doubled (they
    start specifiers and variables), quoted when it has spaces or quotes."""
    escaped = word.replace("%", "%%").replace("$", "$$")
    if escaped and not any(c in escaped for c in " \t\n\"'\\;"):
        return escaped
    return '"' + escaped.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_service(executable: Path, config: Path, bootstrap_kubeconfig: Path | None) -> str:
    """The service unit that runs `executable run --config config`."""
    argv = [str(executable), "run", "--config", str(config)]
    if bootstrap_kubeconfig is not None:
        argv += ["--bootstrap-kubeconfig", str(bootstrap_kubeconfig)]
    return f"""\
# Written by `vkubelet host install` (docs/host-install.md); run it again to change it.
[Unit]
Description=vkubelet, a virtual kubelet (host install)
Wants=network-online.target
After=network-online.target

[Service]
Type=exec
ExecStart={" ".join(systemd_quote(word) for word in argv)}
Restart=always
RestartSec=5
# The VMs outlive the agent: only the agent gets the stop signal. (Each QEMU runs in a scope of
# {SLICE} anyway; this also spares one started before the agent ran under systemd.)
KillMode=process
KillSignal=SIGTERM
TimeoutStopSec=30
StateDirectory=vkubelet
StateDirectoryMode=0700
ConfigurationDirectory=vkubelet
Environment=PYTHONUNBUFFERED=1
SyslogIdentifier=vkubelet
LimitNOFILE=1048576

[Install]
WantedBy=multi-user.target
"""


def render_slice() -> str:
    """The slice of every VM's scope: their memory and CPU, apart from the agent's service."""
    return """\
# Written by `vkubelet host install` (docs/host-install.md).
[Unit]
Description=vkubelet virtual machines
Before=slices.target

[Slice]
"""


def install(
    config: Path,
    *,
    executable: Path,
    unit_dir: Path = SYSTEM_UNITS,
    bootstrap_kubeconfig: Path | None = None,
    start: bool = True,
) -> list[Path]:
    """Check `config`, write the units into `unit_dir`, and with `start` enable and (re)start
    the service; the files written. Nothing is written when the config is refused."""
    config = config.resolve()
    load_agent_config(config)  # errors name the file and the field
    if bootstrap_kubeconfig is not None:
        bootstrap_kubeconfig = bootstrap_kubeconfig.resolve()
        if not bootstrap_kubeconfig.is_file():
            raise ConfigError(f"--bootstrap-kubeconfig: {bootstrap_kubeconfig} is not a file")
    if start and not SYSTEMD_RUNTIME.is_dir():
        raise ConfigError(
            "systemd is not running on this host (no /run/systemd/system): pass --no-start to "
            "only write the units, and run `vkubelet run --config ...` another way"
        )
    unit_dir.mkdir(parents=True, exist_ok=True)
    service, slice_ = unit_dir / UNIT, unit_dir / SLICE
    unit = render_service(executable, config, bootstrap_kubeconfig)
    write_atomic(service, unit, mode=0o644, durable=True)
    write_atomic(slice_, render_slice(), mode=0o644, durable=True)
    if start:
        systemctl = shutil.which("systemctl") or "systemctl"
        for argv in (["daemon-reload"], ["enable", UNIT], ["restart", UNIT]):
            subprocess.run([systemctl, *argv], check=True)
    return [service, slice_]
