import sys
import time
from pathlib import Path

from vkubelet.devcluster import _proc


def test_stop_kills_the_whole_process_group_including_children(tmp_path: Path) -> None:
    marker = f"vkubelet-proc-test-{time.monotonic_ns()}"
    script = (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', '{marker}'])\n"
        "time.sleep(60)\n"
    )
    ref = _proc.start([sys.executable, "-c", script, marker], tmp_path / "log", cwd=tmp_path)
    deadline = time.monotonic() + 10
    while len(_proc.processes_mentioning(marker)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_proc.processes_mentioning(marker)) == 2
    _proc.stop(ref, grace=5)
    assert not _proc.is_alive(ref)
    assert _proc.processes_mentioning(marker) == []


def test_a_recorded_pid_with_another_start_time_is_not_ours(tmp_path: Path) -> None:
    ref = _proc.start(["sleep", "30"], tmp_path / "log", cwd=tmp_path)
    try:
        assert _proc.is_alive(ref)
        stranger = _proc.ProcessRef(ref.pid, ref.start_time + 1)
        assert not _proc.is_alive(stranger)
        _proc.stop(stranger)  # must not signal a process we cannot prove is ours
        assert _proc.is_alive(ref)
    finally:
        _proc.stop(ref)


def test_sigterm_ignoring_process_is_killed_after_grace(tmp_path: Path) -> None:
    script = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    ref = _proc.start([sys.executable, "-c", script], tmp_path / "log", cwd=tmp_path)
    time.sleep(0.3)
    started = time.monotonic()
    _proc.stop(ref, grace=0.5)
    assert not _proc.is_alive(ref)
    assert time.monotonic() - started < 5
