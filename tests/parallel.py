"""pytest plugin for parallel runs of this suite (`make test`: pytest-xdist, `-n 4`).

Most of the suite's time is waiting (outage windows, timeouts, QEMU boots, clusters starting),
so a few workers on two cores finish it in a fraction of the serial time. Each worker is its own
pytest session: session fixtures (the dev cluster, the lower cluster) are per worker, with names,
ports, state dirs and network namespaces already unique per process. What this plugin adds:

- Work units. A unit runs in one worker: a module (its module fixtures are made once), or every
  test using one of `ONE_PER_RUN`'s session fixtures, which cost a whole cluster (or two vm
  agents): the run starts it once instead of once per worker. xdist's own `--dist loadgroup`
  cannot group by fixture, and under pytest 9 it cannot group at all (it renames node ids
  through an attribute pytest 9 no longer reads), so the workers write the units to a file the
  controller's scheduler reads.
- Longest unit first: the units are ordered by the durations of earlier runs (kept in the
  vkubelet cache; a test never timed counts `UNKNOWN_*` seconds), so that the many short units
  fill the workers' ends instead of one long unit starting last.
- A worker gets its next unit only when idle. xdist hands a worker its next unit while it still
  runs two tests of the current one, which can queue a five-minute unit behind another while a
  second worker has nothing to do.

A serial run (`-n 0`, `make test PARALLEL=0`) uses none of this except recording durations.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from vkubelet.devcluster._build import cache_root

#: Session fixtures whose tests all go to one worker (one lower cluster, one pair of vm nodes per
#: run, not per worker).
ONE_PER_RUN = ("lower_cluster", "worker_cluster", "session_vm_nodes")
#: Estimated seconds of a test without a recorded duration: integration tests wait for processes.
UNKNOWN_INTEGRATION = 20.0
UNKNOWN_UNIT = 0.2

_UNITS_KEY = "vkubelet_units_file"
_units_file = pytest.StashKey[Path]()


def durations_file() -> Path:
    return cache_root() / "test-durations.json"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomically: a reader (another run) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as out:
        json.dump(data, out, indent=0, sort_keys=True)
    Path(tmp).replace(path)


def _unit(item: pytest.Item) -> str:
    for fixture in ONE_PER_RUN:
        if fixture in getattr(item, "fixturenames", ()):
            return fixture
    return item.nodeid.split("::")[0]


def _estimate(item: pytest.Item, known: dict[str, float]) -> float:
    if item.nodeid in known:
        return known[item.nodeid]
    return UNKNOWN_INTEGRATION if item.get_closest_marker("integration") else UNKNOWN_UNIT


# --- controller ------------------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        return
    config.pluginmanager.register(_DurationRecorder(), "vkubelet-durations")
    if getattr(config.option, "numprocesses", None):
        units_dir = Path(tempfile.mkdtemp(prefix="vkubelet-units-"))
        config.add_cleanup(lambda: shutil.rmtree(units_dir, ignore_errors=True))
        config.stash[_units_file] = units_dir / "units.json"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """Tell each worker where to write the units (xdist's controller hook)."""
    path = node.config.stash.get(_units_file, None)
    if path is not None:
        node.workerinput[_UNITS_KEY] = str(path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadfile" or _units_file not in config.stash:
        return None
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def __init__(self, config: pytest.Config, log: Any, units_file: Path) -> None:
            super().__init__(config, log)
            config.option.loadscopereorder = False  # keep the workers' longest-first order
            self.units_file = units_file
            self.units: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.units is None:  # all workers have collected: the file is there
                self.units = _read_json(self.units_file)
            return self.units.get(nodeid) or nodeid.split("::")[0]

        def _reschedule(self, node: Any) -> None:
            # A worker holds back its last test until it knows the next one (for teardown), so
            # one pending test means it is idle: only then does it get its next unit.
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
            elif self._pending_of(self.assigned_work[node]) <= 1:
                self._assign_work_unit(node)

    return UnitScheduling(config, log, config.stash[_units_file])


class _DurationRecorder:
    """Sums each test's setup, call and teardown seconds (in the controller, from all workers)
    and merges them into the durations file at the end, for the next run's order."""

    def __init__(self) -> None:
        self.measured: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.measured[report.nodeid] += report.duration

    def pytest_sessionfinish(self) -> None:
        measured = self.measured
        if not measured:
            return
        path = durations_file()
        with contextlib.suppress(OSError):  # a read-only cache costs only the order
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.with_name(f".{path.name}.lock").open("a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # runs side by side merge, not overwrite
                known = _read_json(path)
                known.update({k: round(v, 2) for k, v in measured.items()})
                _write_json(path, known)


# --- workers ---------------------------------------------------------------------------------


@pytest.hookimpl(trylast=True)  # after the integration marks are set
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None or _UNITS_KEY not in workerinput:
        return
    known = {k: v for k, v in _read_json(durations_file()).items() if isinstance(v, int | float)}
    units = {item.nodeid: _unit(item) for item in items}
    cost: dict[str, float] = defaultdict(float)
    for item in items:
        cost[units[item.nodeid]] += _estimate(item, known)
    first_seen = {unit: i for i, unit in reversed(list(enumerate(units.values())))}
    position = {item.nodeid: i for i, item in enumerate(items)}
    # Every worker sorts the same items with the same file: xdist checks the orders are equal.
    items.sort(
        key=lambda it: (-cost[units[it.nodeid]], first_seen[units[it.nodeid]], position[it.nodeid])
    )
    if workerinput.get("workerid") == "gw0":
        _write_json(Path(workerinput[_UNITS_KEY]), units)
