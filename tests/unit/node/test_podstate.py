"""The pod controller's per-pod state: its invariants, transition by transition."""

from __future__ import annotations

import sys
from typing import Any

from vkubelet.node._podstate import PodState


def running() -> dict[str, Any]:
    return {"phase": "Running", "containerStatuses": [{"name": "app", "state": {"running": {}}}]}


def finished() -> dict[str, Any]:
    return {"phase": "Running", "containerStatuses": [{"name": "app", "state": {"terminated": {}}}]}


def test_a_report_before_create_returns_is_kept_for_the_pod_it_names() -> None:
    state = PodState()
    assert state.reported("uid-1", finished())
    assert not state.stopped  # nothing runs yet
    state.created("uid-1", b"digest")
    assert state.report_for("uid-1") is not None
    assert state.stopped  # the report said its containers had all stopped


def test_a_report_naming_no_pod_belongs_to_the_next_pod_run() -> None:
    state = PodState()
    state.reported("", running())
    state.adopted("uid-1")
    assert state.report_uid == "uid-1"
    assert state.report_for("uid-1") is not None


def test_a_report_about_an_earlier_pod_is_dropped_when_the_next_one_runs() -> None:
    state = PodState()
    state.reported("old", finished())
    state.created("new", b"d")
    assert state.report is None
    assert not state.stopped


def test_a_report_about_another_pod_than_the_running_one_changes_nothing() -> None:
    state = PodState()
    state.created("new", b"d")
    assert not state.reported("old", finished())
    assert state.report is None and not state.stopped


def test_a_pod_counts_as_stopped_only_once_asked_to_stop_and_stopped() -> None:
    state = PodState()
    state.created("uid-1", b"d")
    state.reported("uid-1", finished())
    assert state.stopped and not state.stopped_pod()
    state.deletion_requested("other")
    assert not state.deleting
    state.deletion_requested("uid-1")
    assert state.stopped_pod()


def test_replacement_forgets_everything_about_the_old_pod() -> None:
    state = PodState()
    state.created("uid-1", b"d")
    state.reported("uid-1", running())
    state.written_status(b"w", b"s")
    state.deletion_requested("uid-1")
    state.replaced()
    assert (state.uid, state.applied, state.deleting, state.stopped) == (None, None, False, False)
    assert state.report is None and state.written is None and state.gone is None


def test_running_another_uid_resets_what_was_known_of_the_previous_one() -> None:
    state = PodState()
    state.created("uid-1", b"d")
    state.written_status(b"w", b"s")
    state.deletion_requested("uid-1")
    state.adopted("uid-2")
    assert state.applied is None and state.written is None and not state.deleting


def test_adopting_the_same_pod_again_keeps_what_was_applied_and_written() -> None:
    state = PodState()
    state.created("uid-1", b"d")
    state.written_status(b"w", b"s")
    state.adopted("uid-1")
    assert state.applied == b"d" and state.written == (b"w", b"s")


def test_a_newer_report_survives_the_reconciliation_of_an_older_one() -> None:
    state = PodState()
    state.created("uid-1", b"d")
    state.reported("uid-1", running())
    first = state.report_for("uid-1")
    assert first is not None
    state.reported("uid-1", finished())
    state.report_done(first)
    assert state.report is not None
    state.report_done(state.report)
    assert state.report is None


def test_creation_clears_the_waiting_status() -> None:
    state = PodState()
    state.waiting_written("uid-1", "CreateContainerConfigError", "missing")
    state.created("uid-1", b"d")
    assert state.waiting is None


def test_the_state_of_a_pod_is_small() -> None:
    state = PodState()
    assert not hasattr(state, "__dict__")
    assert sys.getsizeof(state) <= 128
