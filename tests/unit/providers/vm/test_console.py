"""The serial console as container logs: copied line by line into a rotated CRI log, the
console file's copied bytes given back to the disk, a restarted tailer going on where the last
one stopped."""

from __future__ import annotations

from pathlib import Path

from vkubelet.providers.vm._console import ConsoleTailer
from vkubelet.sdk.logs import LogParser, LogRotation, rotated_logs

ROTATION = LogRotation(max_bytes=LogRotation.MIN_BYTES, max_files=3)


def _on_disk(path: Path) -> int:
    return sum(f.stat().st_blocks * 512 for f in ([path] if path.is_file() else path.iterdir()))


def _numbers(log: Path) -> list[int]:
    """The numbered lines of the log and its rotated files, oldest first."""
    files = [*rotated_logs(log), log]
    lines = [line for f in files for line in LogParser().feed(f.read_bytes())]
    return [int(line.content.split()[1]) for line in lines if line.content.startswith(b"line ")]


def test_a_chatty_console_stays_within_the_rotation_on_disk_and_loses_no_line(
    tmp_path: Path,
) -> None:
    console, logs = tmp_path / "run" / "console.log", tmp_path / "logs" / "vm"
    console.parent.mkdir()
    log = logs / "0.log"
    bound = ROTATION.max_bytes * ROTATION.max_files

    def tailer() -> ConsoleTailer:  # a new one each time, as after an agent restart
        return ConsoleTailer(console, log, tmp_path / "run" / "console.offset", rotation=ROTATION)

    written = 0
    with console.open("ab") as qemu:  # QEMU's logfile=...,logappend=on
        for _ in range(20):  # 20 x ~100 KB: 2 MB through a 192 KiB log directory
            for _ in range(1000):
                qemu.write(b"line %07d of the guest's console %s\r\n" % (written, b"." * 64))
                written += 1
            qemu.flush()
            while tailer().copy():
                pass
            assert _on_disk(logs) <= bound
            assert _on_disk(console) <= 64 * 1024  # the copied bytes' blocks given back
        qemu.write(b"a last line without its newline")
        qemu.flush()
    assert console.stat().st_size > 2_000_000  # offsets unchanged: QEMU appends as before
    tailer().copy(final=True)
    numbers = _numbers(log)
    assert numbers == list(range(numbers[0], written))  # the newest lines, no gap, none twice
    assert log.read_bytes().endswith(b" stdout P a last line without its newline\n")
    assert len(rotated_logs(log)) == ROTATION.max_files - 1
    assert log.stat().st_mode & 0o777 == 0o600
