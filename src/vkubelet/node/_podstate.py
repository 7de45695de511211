"""What the pod controller knows about the pod of one key (namespace/name) beyond the API's copy.

One small record per key, changed only through transitions named after what happened, so that
its invariants hold by construction instead of by resetting eight dicts by hand:

- `uid` is the pod the provider runs for the key (None: none, as far as we know). Everything
  else but `waiting`, `gone` and a pending report is about that pod, and a transition that
  changes `uid` (`created`, `adopted`, `replaced`) resets it;
- `stopped` says that the containers of `uid` have all stopped, as its latest report showed
  (or the provider no longer runs it); a report about another pod never changes it. The API
  object of a pod being deleted is removed once `stopped` holds; the provider's copy is
  deleted when the API's is gone unless `stopped_pod()` (asked to stop, and stopped);
- a report is kept until the status queue has reconciled it with the API (`report_done`), and
  a report that arrives before the provider's `create_pod` returned (or before the agent knew
  of the pod at all) is kept for the pod it names, or for the next one if it names none;
- `written` holds digests of a status the API accepted, never of a failed write.

The record is per pod, so it is small: `__slots__`, shared strings and digests, and the
report (the only big part) dropped once written.
"""

from __future__ import annotations

from typing import Any

from ._podrecord import PodRecord

TERMINAL = ("Succeeded", "Failed")


def all_terminated(status: dict[str, Any]) -> bool:
    if status.get("phase") in TERMINAL:
        return True
    statuses = status.get("containerStatuses") or []
    return bool(statuses) and all("terminated" in (s.get("state") or {}) for s in statuses)


class PodState:
    __slots__ = (
        "applied",
        "deleting",
        "ephemeral",
        "gone",
        "report",
        "report_uid",
        "stopped",
        "uid",
        "waiting",
        "written",
    )

    def __init__(self) -> None:
        self.uid: str | None = None  # the pod the provider runs
        self.applied: bytes | None = None  # digest of what it was given (None: unknown)
        self.deleting = False  # we asked the provider to stop it
        self.stopped = False  # its containers have all stopped
        # Latest provider status not yet reconciled with the API, and the UID it is about
        # ("" if the provider did not say: the pod it runs, or the one it is starting).
        self.report: dict[str, Any] | None = None
        self.report_uid = ""
        # Digests of the status we wrote and of the API's status after the write: the API's
        # status also holds conditions the provider does not report (PodScheduled), so
        # comparing a report with it alone would find a difference every time.
        self.written: tuple[bytes, bytes] | None = None
        self.waiting: tuple[str, str, str] | None = None  # (UID, reason, message) written
        self.gone: PodRecord | None = None  # the API's last copy of a pod deleted from it
        # Ephemeral containers of `uid` handed to the provider (or reported unsupported), and
        # the waiting state the agent reports itself for those the provider cannot run.
        self.ephemeral: dict[str, dict[str, str] | None] = {}

    def __repr__(self) -> str:
        return (
            f"PodState(uid={self.uid!r}, deleting={self.deleting}, stopped={self.stopped}, "
            f"report={self.report_uid if self.report is not None else None!r})"
        )

    # -- the provider runs a pod ------------------------------------------------------------------
    def created(self, uid: str, applied: bytes | None) -> None:
        """`create_pod` returned: the provider runs `uid`, given what `applied` digests."""
        self._runs(uid)
        self.applied = applied
        self.waiting = None

    def adopted(self, uid: str) -> None:
        """The provider already runs `uid` (after a restart), or refused it for good: it is
        never created again; what it was given is checked at the next sync."""
        self._runs(uid)

    def _runs(self, uid: str) -> None:
        if uid != self.uid:
            self.deleting = False
            self.stopped = False
            self.written = None
            self.applied = None
            self.ephemeral = {}
        self.uid = uid
        if self.report is not None:
            if self.report_uid in ("", uid):
                self.report_uid = uid
                self.stopped = all_terminated(self.report)
            else:
                self.report = None  # about an earlier pod of the same name

    def applied_now(self, applied: bytes) -> None:
        """The provider has the pod as `applied` digests (an update, or an adopted pod's
        annotation says so)."""
        self.applied = applied

    def replaced(self) -> None:
        """The API's pod of this name has a new UID; the provider's old pod has been stopped."""
        self.uid = None
        self.applied = None
        self.deleting = False
        self.stopped = False
        self.report = None
        self.report_uid = ""
        self.written = None
        self.gone = None
        self.ephemeral = {}

    # -- stopping ---------------------------------------------------------------------------------
    def deletion_requested(self, uid: str) -> None:
        """`delete_pod` returned for `uid` (only then: a failed call is retried)."""
        if uid == self.uid:
            self.deleting = True

    def provider_stopped(self, uid: str) -> None:
        """The provider no longer runs `uid` (it said so, or it no longer lists it)."""
        if uid == self.uid:
            self.stopped = True

    def deleted_from_api(self, last: PodRecord) -> None:
        self.gone = last

    def stopped_pod(self) -> bool:
        """True if the pod the provider ran has been asked to stop and has stopped."""
        return self.uid is not None and self.deleting and self.stopped

    # -- provider -> API --------------------------------------------------------------------------
    def reported(self, uid: str, status: dict[str, Any]) -> bool:
        """A status from the provider; False if it is about another pod than the one it runs."""
        uid = uid or (self.uid or "")
        if self.uid is not None and uid != self.uid:
            return False  # a late report about an earlier pod of the same name
        self.report = status
        self.report_uid = uid
        if self.uid is not None:
            self.stopped = all_terminated(status)
        return True

    def report_for(self, uid: str) -> dict[str, Any] | None:
        """The pending report if it is about `uid` (or about no pod in particular)."""
        if self.report is not None and self.report_uid in ("", uid):
            return self.report
        return None

    def report_done(self, report: dict[str, Any]) -> None:
        """`report` has been reconciled with the API; drop it unless a newer one came."""
        if self.report is report:
            self.report = None

    def written_status(self, wanted: bytes, stored: bytes) -> None:
        """The API accepted our write of a status digesting `wanted`; it now digests `stored`."""
        self.written = (wanted, stored)

    def ephemeral_handed(self, name: str, waiting: dict[str, str] | None = None) -> None:
        """Ephemeral container `name` of the running pod was handed to the provider (never
        again), or could not be: `waiting` is the reason and message the agent reports (one
        waiting for its env to resolve is handed once it does)."""
        self.ephemeral[name] = waiting

    def waiting_written(self, uid: str, reason: str, message: str) -> None:
        self.waiting = (uid, reason, message)
