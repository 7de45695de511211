"""`vkubelet host install`: the systemd units of the host install (docs/host-install.md).

systemd is not PID 1 where the tests run: the units are checked by `systemd-analyze verify`, and
the integration test (tests/integration/vm/test_vm_provider.py) runs the unit's ExecStart as
written, stops it with the unit's stop signal and starts it again with its VMs adopted.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from vkubelet.agent import _hostinstall
from vkubelet.node import ConfigError

from .units import unit_settings

AGENT_YAML = """\
kubeconfig: /etc/vkubelet/kubeconfig
certDir: /var/lib/vkubelet/pki
nodes:
  - {name: hv-1, provider: vm, providerConfig: vm.yaml, internalIP: 10.0.0.5}
"""


def test_the_units_run_this_vkubelet_with_the_config_and_spare_the_vms_on_stop(
    tmp_path: Path,
) -> None:
    config = tmp_path / "etc" / "agent.yaml"
    config.parent.mkdir()
    config.write_text(AGENT_YAML)
    executable = tmp_path / "opt bin" / "vkubelet"
    written = _hostinstall.install(
        config, executable=executable, unit_dir=tmp_path / "units", start=False
    )
    assert [p.name for p in written] == ["vkubelet.service", "vkubelet-vms.slice"]
    service = unit_settings(written[0].read_text(), "Service")
    assert shlex.split(service["ExecStart"]) == [str(executable), "run", "--config", str(config)]
    assert service["KillMode"] == "process" and service["KillSignal"] == "SIGTERM"
    assert float(service["TimeoutStopSec"]) > 10  # the agent's own bound
    assert service["Restart"] == "always"
    assert oct(written[0].stat().st_mode & 0o777) == "0o644"


def test_systemd_analyze_verify_accepts_both_units_without_a_word(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian package systemd)")
    config = tmp_path / "agent.yaml"
    config.write_text(AGENT_YAML)
    bootstrap = tmp_path / "bootstrap.kubeconfig"
    bootstrap.write_text("{}")
    written = _hostinstall.install(
        config,
        executable=Path(shutil.which("true") or "/bin/true"),  # verify checks it exists
        unit_dir=tmp_path / "units",
        bootstrap_kubeconfig=bootstrap,
        start=False,
    )
    check = subprocess.run(
        [analyze, "verify", *map(str, written)], capture_output=True, text=True, check=False
    )
    assert (check.returncode, check.stdout + check.stderr) == (0, "")


def test_a_bad_config_is_refused_naming_the_file_and_field_and_nothing_is_written(
    tmp_path: Path,
) -> None:
    config = tmp_path / "agent.yaml"
    config.write_text(AGENT_YAML.replace("internalIP: 10.0.0.5", "internalIP: nowhere"))
    with pytest.raises(ConfigError, match=r"agent\.yaml: nodes\[0\]\.internalIP"):
        _hostinstall.install(
            config, executable=Path("/usr/bin/vkubelet"), unit_dir=tmp_path / "u", start=False
        )
    assert not (tmp_path / "u").exists()


def test_starting_without_systemd_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_hostinstall, "SYSTEMD_RUNTIME", tmp_path / "absent")
    config = tmp_path / "agent.yaml"
    config.write_text(AGENT_YAML)
    with pytest.raises(ConfigError, match="pass --no-start"):
        _hostinstall.install(config, executable=Path("/usr/bin/vkubelet"), unit_dir=tmp_path / "u")
    assert not (tmp_path / "u").exists()


@pytest.mark.parametrize(
    ("word", "quoted"),
    [
        ("/usr/bin/vkubelet", "/usr/bin/vkubelet"),
        ("/etc/my configs/a.yaml", '"/etc/my configs/a.yaml"'),
        ("/etc/100%/$HOME.yaml", "/etc/100%%/$$HOME.yaml"),
        ('say "hi"', '"say \\"hi\\""'),
    ],
)
def test_exec_start_words_are_quoted_for_systemd(word: str, quoted: str) -> None:
    assert _hostinstall.systemd_quote(word) == quoted
