from pathlib import Path

import pytest

from vkubelet.devcluster._cluster import StartupFailed, _wait_until

# What a kubelet logged when the machine's inotify instances had run out (2026-11-29): the
# watcher error first, then a fatal error that names something else.
KUBELET_OUT_OF_INOTIFY = """\
E1129 12:52:02.515110   13496 dynamic_cafile_content.go:170] "Failed to watch CA file, will retry later" err="error creating fsnotify watcher: too many open files"
E1129 12:52:02.517730   13496 run.go:72] "command failed" err="failed to run Kubelet: validate service connection: validate CRI v1 runtime API for endpoint \\"unix:///run/containerd/containerd.sock\\": rpc error: code = Unimplemented desc = unknown service runtime.v1.RuntimeService"
"""  # noqa: E501


def dead_component(log: Path) -> str:
    with pytest.raises(StartupFailed) as failed:
        _wait_until(
            "node w-0 to become Ready", lambda: False, 5, died=lambda: ("kubelet", log), log=log
        )
    return str(failed.value)


def test_a_component_dead_of_exhausted_inotify_instances_names_the_limit_to_raise(
    tmp_path: Path,
) -> None:
    log = tmp_path / "kubelet.log"
    log.write_text(KUBELET_OUT_OF_INOTIFY)
    message = dead_component(log)
    assert "ran out of inotify instances: fs.inotify.max_user_instances is" in message
    assert "sysctl -w fs.inotify.max_user_instances=512" in message
    assert "unknown service runtime.v1.RuntimeService" in message  # the log's tail still follows


def test_a_component_dead_of_something_else_gets_no_inotify_hint(tmp_path: Path) -> None:
    log = tmp_path / "kubelet.log"
    log.write_text('E1129 run.go:72] "command failed" err="open /x: too many open files"\n')
    assert "inotify" not in dead_component(log)
