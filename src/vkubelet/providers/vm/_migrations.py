"""Live migration's pod bookkeeping: the target pod receives the VM (from its run), the source
pod's `migrate-to` sends it (from `update_pod`), both reported as pod conditions; the engine
(QEMU, NBD, the token-checked ports) is `_migrate`'s and knows no pod.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from ..._files import write_private
from ...kube import ApiError
from ...sdk import PodRunner, Terminated
from ...sdk.logs import append_log
from ._backend import GuestAddress, MachineHandle
from ._console import ConsoleTailer
from ._lvmigrate import ArrivingDomain, MigratableDomain
from ._migrate import (
    MIGRATE_TO,
    MIGRATION_CONDITION,
    MIGRATION_SOURCE,
    MIGRATION_TOKEN,
    POLL,
    RUNNING,
    TARGET_CONDITION,
    ConsolePort,
    Endpoint,
    IncomingMigration,
    MigrationError,
    Progress,
    block_jobs,
    drop_jobs,
    hand_over,
    migrate_out,
    outcome_message,
    until_running,
)
from ._net import readdress
from ._qmp import ExecuteError, Monitor, MonitorUnavailable
from ._vm import VM, VMHost

__all__ = ["Migrations", "endpoint_problem", "target_verdict"]

log = logging.getLogger(__name__)


def _monitor(machine: MachineHandle) -> Monitor:
    if machine.monitor is None:
        raise MigrationError(f"the {machine.runtime} runtime cannot migrate VMs yet")
    return machine.monitor


HISTORY_TIMEOUT = 30.0
CONSOLE_DRAIN = 5.0  # a moved domain's console stream ends this soon after libvirt's call
ANSWER_WAIT = 5.0  # a failed target keeps its console port this long for the source's question
DEPARTED_WAIT = 60.0  # a source whose domain left while no agent ran waits this long for the target
VM_NODE_CONDITION = "Accelerator"  # only the vm provider reports it (the controller's rule too)


RECORD = "migration.json"  # the source's migration, in the VM's directory (see `Migrations`)
TARGET_RECORD = "migration-target.json"  # a libvirt target's published endpoint (no token)
_ACTIVE = ("setup", "active", "pre-switchover", "device", "cancelling", "wait-unplug")


class Migrations:
    """Live migration for `VMProvider`: the target pod's incoming side (`receive`, from its
    run) and the source pod's `migrate-to` (`update`, from `update_pod`).

    A restarted agent finishes or rolls back what the previous one left (`resume_incoming`,
    `resume_outgoing`, `ended_while_away`, from the adopted VM's run): the source writes its
    migration's state (`RECORD`: endpoint, token, running/completed/failed, the condition's
    message) before each step that matters, and QEMU itself says where the stream is (on
    libvirt: the daemon's migration job, which goes on without the agent that started it)."""

    def __init__(self, host: VMHost) -> None:
        self.host = host
        self._sending: dict[str, asyncio.Task[None]] = {}

    @staticmethod
    def is_target(vm: VM) -> bool:
        """A target that has not received its VM yet (afterwards it boots like any VM)."""
        arrived = vm.launch is not None and vm.launch.migrated_in
        return bool(vm.annotations.get(MIGRATION_SOURCE)) and not arrived

    # -- target ----------------------------------------------------------------------------------
    async def receive(self, vm: VM, machine: MachineHandle, runner: PodRunner, run: int) -> None:
        """Export the disks, publish the endpoint, wait for the VM; then its console history
        goes first into this run's log (before the console tailer starts)."""
        if isinstance(machine, ArrivingDomain):
            await self._receive_domain(vm, machine, runner, run)
            return
        host = self.host
        incoming: IncomingMigration | None = None
        try:
            token = vm.annotations.get(MIGRATION_TOKEN, "")
            incoming = IncomingMigration(
                _monitor(machine), host.host_ip, token, vm.dir / "nbd-in.sock"
            )
            try:
                endpoint = replace(await incoming.open(), pod=vm.key.split("/", 1)[-1])
            except (MonitorUnavailable, ExecuteError, OSError) as e:
                raise MigrationError(f"could not prepare the target: {e}") from None
            runner.set_condition(TARGET_CONDITION, "True", "Ready", endpoint.to_json())
            host.event(vm, "Normal", "MigrationTargetReady", endpoint.to_json())
            await incoming.wait()
            incoming.confirm()  # the source may quit its QEMU now, not before
            self._arrived(vm, runner)
            # Its route and gateway first: the console history may take seconds to come,
            # and until then answers from the guest would go to the source's gateway.
            network = await self._claim(vm)
            host.spawn(self._readdress(vm, machine, network), name=f"readdress {vm.uid}")
            history = await incoming.history(HISTORY_TIMEOUT)
            append_log(host.log_path(vm.uid, vm.container, run), history, host.config.log_rotation)
            await incoming.stop_exports()
        except MigrationError as e:
            # QEMU surely gone first: the source resumes its guest on our word (the verdict, or
            # this condition), so the guest must not run here too.
            await machine.kill()
            runner.set_condition(TARGET_CONDITION, "False", "Failed", str(e))
            host.event(vm, "Warning", "MigrationFailed", str(e))
            if incoming is not None:
                incoming.fail(str(e))
                if incoming.streaming:  # the stream may have ended: its source asks us now
                    await incoming.answered(ANSWER_WAIT)
            raise
        finally:
            if incoming is not None:
                await incoming.close()

    async def _receive_domain(
        self, vm: VM, machine: MachineHandle, runner: PodRunner, run: int, *, port: int = 0
    ) -> None:
        """A libvirt target: publish where the source's daemon sends the domain, then wait
        for it (`_lvmigrate`). The console history comes as on QEMU, to our console port once
        the domain runs here, and goes first into this run's log (before the console tailer
        starts: what the guest prints here meanwhile waits in the console file), an imported
        domain's as any other's."""
        assert isinstance(machine, ArrivingDomain)
        host = self.host
        token = vm.annotations.get(MIGRATION_TOKEN, "")
        console = ConsolePort(token)
        try:
            try:
                port = await console.open(host.host_ip, port)
            except OSError as e:
                raise MigrationError(f"could not prepare the target: {e}") from None
            endpoint = Endpoint(
                host=host.host_ip,
                migration_port=0,
                nbd_port=0,
                console_port=port,
                disks=tuple(dev for dev, _ in machine.target.files),
                pod=vm.key.split("/", 1)[-1],
                libvirt=machine.target,
            )
            runner.set_condition(TARGET_CONDITION, "True", "Ready", endpoint.to_json())
            host.event(vm, "Normal", "MigrationTargetReady", endpoint.to_json())
            write_private(vm.dir / TARGET_RECORD, endpoint.to_json())  # (`resume_incoming`)
            await machine.arrive()
            console.confirm()  # (libvirt decided: the source only learns its history came)
            self._arrived(vm, runner)
            network = await self._claim(vm)
            host.spawn(self._readdress(vm, machine, network), name=f"readdress {vm.uid}")
            history = await console.history(HISTORY_TIMEOUT)
            log_path = host.log_path(vm.uid, vm.container, run)
            append_log(log_path, history, host.config.log_rotation)
        except MigrationError as e:
            runner.set_condition(TARGET_CONDITION, "False", "Failed", str(e))
            host.event(vm, "Warning", "MigrationFailed", str(e))
            console.fail(str(e))
            raise
        finally:
            console.close()

    def _arrived(self, vm: VM, runner: PodRunner) -> None:
        assert vm.launch is not None
        vm.launch.migrated_in = True
        vm.save()
        runner.set_condition(TARGET_CONDITION, "False", "Completed", "the VM runs here")
        self.host.event(vm, "Normal", "Migrated", "the VM arrived and runs here")

    async def resume_incoming(self, vm: VM, machine: MachineHandle, runner: PodRunner) -> None:
        """An adopted target the VM had not (yet, as far as we knew) arrived at. Its ports died
        with the previous agent: a stream QEMU already reads goes on (the source decides its
        end), one not started never will (MigrationError: the caller stops this QEMU, so the
        source's migration fails and its guest runs on there). A libvirt target waits for its
        domain again, as its first run did: the target host's daemon receives it without any
        agent; its endpoint stays the one published (the console port opened again on the same
        port when it is free), so a source yet to send its history still can."""
        if isinstance(machine, ArrivingDomain):
            port = 0
            with contextlib.suppress(OSError, MigrationError):
                port = Endpoint.from_json((vm.dir / TARGET_RECORD).read_text()).console_port
            await self._receive_domain(vm, machine, runner, vm.run, port=port)
            return
        monitor = _monitor(machine)
        try:
            try:
                if await monitor.status() != "running":
                    info = await monitor.execute("query-migrate")
                    if info.get("status") in (None, "none"):
                        raise MigrationError("the target's agent restarted before the VM came")
                    await until_running(monitor)
            except (MonitorUnavailable, ExecuteError) as e:
                raise MigrationError(f"the incoming migration failed: {e}") from None
        except MigrationError as e:
            runner.set_condition(TARGET_CONDITION, "False", "Failed", str(e))
            self.host.event(vm, "Warning", "MigrationFailed", str(e))
            raise
        self._arrived(vm, runner)
        network = await self._claim(vm)
        log.warning("%s: the VM arrived while no agent ran: its console history is lost", vm.uid)
        with contextlib.suppress(MonitorUnavailable, ExecuteError):
            await monitor.execute("nbd-server-stop")
        self.host.spawn(self._readdress(vm, machine, network), name=f"readdress {vm.uid}")

    async def _claim(self, vm: VM) -> GuestAddress | None:
        """The guest's address routes here now, first thing after its arrival: a VM that
        keeps its address had it routed to the source until then (see `_net`)."""
        try:
            return await self.host.claim_network(vm)
        except Exception as e:
            self.host.event(vm, "Warning", "MigrationRouteFailed", f"no route to the guest: {e}")
            return None

    async def _readdress(
        self, vm: VM, machine: MachineHandle, network: GuestAddress | None
    ) -> None:
        """The guest still has the source's view of its network (its address, unless it
        keeps it; the source's gateway): give it this node's."""
        if network is None or network.gateway is None or machine.agent is None:
            return
        try:
            await machine.wait_guest_agent(120)
            why = await readdress(machine.agent, network.address, network.prefix, network.gateway)
        except Exception as e:
            why = str(e)
        if why is not None:
            message = f"could not give the guest its address {network.address} here: {why}"
            self.host.event(vm, "Warning", "MigrationReaddressFailed", message)

    # -- source: the record ----------------------------------------------------------------------
    @staticmethod
    def _record(vm: VM) -> dict[str, Any]:
        with contextlib.suppress(OSError, ValueError):
            data = json.loads((vm.dir / RECORD).read_text())
            if isinstance(data, dict):
                return data
        return {}

    @staticmethod
    def _write_record(vm: VM, **record: Any) -> None:
        """Atomically, readable by root only (it holds the token)."""
        write_private(vm.dir / RECORD, json.dumps(record))

    def _failed(
        self,
        vm: VM,
        runner: PodRunner,
        record: dict[str, Any],
        error: str,
        reason: str = "MigrationFailed",
    ) -> None:
        target = None
        with contextlib.suppress(MigrationError):
            target = Endpoint.from_json(str(record.get("endpoint"))).target
        message = json.dumps({"error": error, "target": target})
        self._write_record(vm, **{**record, "state": "failed", "message": message})
        runner.set_condition(MIGRATION_CONDITION, "False", "Failed", message)
        self.host.event(vm, "Warning", reason, f"the VM stays here: {error}")

    # -- source ----------------------------------------------------------------------------------
    def update(self, vm: VM, runner: PodRunner | None, annotations: dict[str, str]) -> None:
        """`migrate-to` (in the pod's newest `annotations`) on a running VM: migrate it (once
        per endpoint)."""
        key = vm.key
        value = annotations.get(MIGRATE_TO)
        if not value or key in self._sending or vm.migrated is not None:
            return
        if self._record(vm).get("endpoint") == value:
            return  # tried (maybe by the previous agent: its VM's run resumes that)
        if runner is None:
            return
        record: dict[str, Any] = {"endpoint": value, "state": "running"}
        try:
            endpoint = Endpoint.from_json(value)
        except MigrationError as e:
            self._failed(vm, runner, record, str(e))
            return
        token = annotations.get(MIGRATION_TOKEN, "")
        if not token:
            self._failed(vm, runner, record, f"no {MIGRATION_TOKEN} beside {MIGRATE_TO}")
            return
        if vm.machine is None or vm.booted_at is None:
            log.warning("%s: migrate-to, but the VM is not running", vm.uid)
            self._failed(vm, runner, record, "the VM is not running")
            return
        self._write_record(vm, **record, token=token)
        task = self.host.spawn(
            self._send(vm, vm.machine, runner, endpoint, token), name=f"migrate {key}"
        )
        self._sending[key] = task
        task.add_done_callback(lambda _: self._sending.pop(key, None))

    async def settled(self, vm: VM) -> None:
        """Until the VM's migration, if one is being sent, has said how it ended: a libvirt
        domain leaves this host (its machine ends) a moment before the call that moved it
        returns, and the run's end must know it migrated."""
        task = self._sending.get(vm.key)
        if task is not None:
            await asyncio.wait({task})

    async def _send(
        self, vm: VM, machine: MachineHandle, runner: PodRunner, endpoint: Endpoint, token: str
    ) -> None:
        host = self.host
        report = self._reporter(runner, endpoint)
        if isinstance(machine, MigratableDomain) != (endpoint.libvirt is not None):
            where = "a libvirt host" if endpoint.libvirt is not None else "a QEMU runtime's node"
            error = f"the target is {where}; this VM runs on the {machine.runtime} runtime"
            self._failed(vm, runner, self._record(vm), error, reason="MigrationRefused")
            return
        monitor = None
        if not isinstance(machine, MigratableDomain):
            try:
                monitor = _monitor(machine)
            except MigrationError as e:
                self._failed(vm, runner, self._record(vm), str(e))
                return
        # Nothing goes out before the endpoint is known to be a vm node's, published for this
        # migration: `migrate-to` is an annotation anyone who may edit the pod can write.
        if (problem := await self._refusal(vm, endpoint, token)) is not None:
            log.warning("%s: %s refused: %s", vm.uid, MIGRATE_TO, problem)
            error = f"{MIGRATE_TO} refused: {problem}"
            self._failed(vm, runner, self._record(vm), error, reason="MigrationRefused")
            return
        report(Progress(phase="migrating" if endpoint.libvirt else "mirroring"))
        log.info("%s: migrating to %s", vm.uid, endpoint.to_json())
        host.event(vm, "Normal", "Migrating", f"to {endpoint.host}")
        try:
            if isinstance(machine, MigratableDomain) and endpoint.libvirt is not None:
                outcome = await machine.migrate_to(
                    endpoint.libvirt, report, max_bandwidth=endpoint.max_bandwidth
                )
            else:
                assert monitor is not None
                outcome = await migrate_out(
                    monitor, endpoint, vm.dir / "nbd.sock", report, token=token
                )
        except MigrationError as e:
            log.warning("%s: migration failed, the VM stays here: %s", vm.uid, e)
            self._failed(vm, runner, self._record(vm), str(e))
            return
        message = json.dumps({**json.loads(outcome_message(outcome)), "target": endpoint.target})
        if endpoint.libvirt is not None:
            await self._moved(vm, machine, runner, endpoint, token, message)
            return
        await self._switched_over(vm, machine, runner, endpoint, token, message)

    @staticmethod
    def _reporter(runner: PodRunner, endpoint: Endpoint) -> Callable[[Progress], None]:
        """The source's progress, as its `Migration` condition (Running)."""

        def report(progress: Progress) -> None:
            message = {**json.loads(progress.message()), "target": endpoint.target}
            runner.set_condition(MIGRATION_CONDITION, "True", "Running", json.dumps(message))

        return report

    async def _refusal(self, vm: VM, endpoint: Endpoint, token: str) -> str | None:
        """Why the source must not connect to `endpoint` (None: it is the target's own)."""
        api = self.host.upper_api
        if api is None:
            return "this agent has no API client to check the target with"
        if not endpoint.pod:
            return "it names no target pod"
        namespace, source = vm.key.split("/", 1)
        try:
            target = await api.get(f"/api/v1/namespaces/{namespace}/pods/{endpoint.pod}")
            node_name = str((target.get("spec") or {}).get("nodeName") or "")
            node = await api.get(f"/api/v1/nodes/{node_name}") if node_name else None
        except ApiError as e:
            if e.not_found:
                return f"target pod {endpoint.pod} or its node does not exist"
            if e.status == 403:  # a node identity reads only its own pods and Node
                return (
                    f"this agent may not read target pod {endpoint.pod} or its node ({e}): grant"
                    " it get on pods and nodes (docs/vm-migration.md, Only a vm node's endpoint)"
                )
            return f"could not read target pod {endpoint.pod} or its node: {e}"
        except (OSError, TimeoutError) as e:
            return f"could not read target pod {endpoint.pod} or its node: {e}"
        return endpoint_problem(endpoint, token, source, self.host.node_name, target, node)

    async def _moved(
        self,
        vm: VM,
        machine: MachineHandle,
        runner: PodRunner,
        endpoint: Endpoint,
        token: str,
        message: str,
    ) -> None:
        """libvirt moved the domain: it runs at the target and is gone from here (libvirt's
        protocol decided; there is nothing to resume). The console history goes to the
        target's console port first, as after QEMU's switchover (`_domain_history`)."""
        self._write_record(vm, **{**self._record(vm), "state": "completed", "message": message})
        if endpoint.console_port:  # (0: the target takes none, an imported domain's)
            await self._domain_history(vm, machine, endpoint, token)
        log.info("%s: migrated: %s", vm.uid, message)
        vm.migrated = message
        runner.set_condition(MIGRATION_CONDITION, "True", "Completed", message)
        self.host.event(vm, "Normal", "Migrated", message)
        runner.finish()

    async def _domain_history(
        self, vm: VM, machine: MachineHandle, endpoint: Endpoint, token: str
    ) -> None:
        """A moved domain's console history to the target. Its console stream here ends with
        its QEMU, a moment after libvirt's call returned, and the machine's end waits for that
        (bounded: the history is a courtesy): then the guest's last lines here are in the
        console file, and what it prints next goes to the target's. The target's verdict only
        says whether it took the history: libvirt's word on where the guest runs was final."""
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(machine.wait(), CONSOLE_DRAIN)
            history, _ = self._console_history(vm, machine)
            verdict = await hand_over(endpoint, history, token)
        except Exception:
            log.exception("%s: the console history is not sent to the target", vm.uid)
            return
        if verdict != RUNNING:
            log.warning("%s: the target took no console history (%s)", vm.uid, verdict)

    async def _switched_over(
        self,
        vm: VM,
        machine: MachineHandle,
        runner: PodRunner,
        endpoint: Endpoint,
        token: str,
        message: str,
    ) -> None:
        """The stream ended, the guest is paused here: send the console history (this run's
        log, with what the console printed last) and ask the target whether the guest runs
        there. Only then end (QEMU quits); if it does not, the guest runs on here (`cont`):
        its RAM and disks are whole here until this QEMU quits."""
        host = self.host
        self._write_record(vm, **{**self._record(vm), "state": "completed", "message": message})
        history, tailer = self._console_history(vm, machine)
        verdict = await hand_over(endpoint, history, token)
        if verdict is None:
            host.event(vm, "Warning", "MigrationUnconfirmed", "asking the API whether it runs")
            verdict = await self._verdict_from_api(vm, endpoint)
        if verdict != RUNNING:
            await self._resume_here(vm, machine, runner, verdict)
            return
        with contextlib.suppress(OSError):
            while tailer is not None and tailer.copy(final=True):
                pass
        log.info("%s: migrated: %s", vm.uid, message)
        vm.migrated = message
        runner.set_condition(MIGRATION_CONDITION, "True", "Completed", message)
        host.event(vm, "Normal", "Migrated", message)
        runner.finish()  # the run's end is the pod's end: it never boots here again
        with contextlib.suppress(MigrationError):
            await _monitor(machine).quit()

    def _console_history(
        self, vm: VM, machine: MachineHandle
    ) -> tuple[bytes, ConsoleTailer | None]:
        """This run's console log, with what the console printed last (whole lines: a resumed
        guest finishes its last one here). The history is a courtesy and the decision that
        follows is not: whatever goes wrong here (a bug included) sends none rather than
        leaving the guest paused at both ends."""
        try:
            cri_log = self.host.log_path(vm.uid, vm.container, vm.run)
            tailer = ConsoleTailer(
                machine.console_log,
                cri_log,
                vm.dir / "console.offset",
                rotation=self.host.config.log_rotation,
            )
            with contextlib.suppress(OSError):
                while tailer.copy():
                    pass
            try:
                return (cri_log.read_bytes() if cri_log.exists() else b""), tailer
            except OSError:
                return b"", tailer
        except Exception:
            log.exception("%s: the console history is not sent to the target", vm.uid)
            return b"", None

    async def _verdict_from_api(self, vm: VM, endpoint: Endpoint) -> str:
        """The target's word from its pod, when its console port did not answer: until it is
        certain (its `MigrationTarget` Completed, or Failed / gone: its QEMU is dead). Never a
        guess: resuming here while the guest runs there would run it twice."""
        namespace = vm.key.split("/", 1)[0]
        path = f"/api/v1/namespaces/{namespace}/pods/{endpoint.pod}"
        api = self.host.upper_api
        while True:
            if api is not None and endpoint.pod:
                try:
                    verdict = target_verdict(await api.get(path))
                except ApiError as e:
                    verdict = target_verdict(None) if e.not_found else None
                except (OSError, TimeoutError):
                    verdict = None
                if verdict is not None:
                    return verdict
            await asyncio.sleep(POLL * 10)

    async def _resume_here(
        self, vm: VM, machine: MachineHandle, runner: PodRunner, verdict: str
    ) -> None:
        """The target does not run the guest: it runs on here (`cont` first, then the record:
        a restart in between asks the target again and resumes again)."""
        why = verdict.removeprefix("failed: ")
        try:
            await _monitor(machine).execute("cont")
        except (MigrationError, MonitorUnavailable, ExecuteError) as e:
            log.warning("%s: could not resume the guest here: %s", vm.uid, e)
        error = f"the target could not run the VM ({why}): it runs here again"
        log.warning("%s: %s", vm.uid, error)
        self._failed(vm, runner, self._record(vm), error)

    def resume(self, vm: VM, machine: MachineHandle, runner: PodRunner) -> None:
        """`resume_outgoing` in the background, as the VM's migration being sent: the run's
        end waits for its word (`settled`; a libvirt domain the daemon moves meanwhile leaves
        before it is reported), and `update` starts no other."""
        key = vm.key
        task = self.host.spawn(self.resume_outgoing(vm, machine, runner), name=f"resume {key}")
        self._sending[key] = task
        task.add_done_callback(lambda _: self._sending.pop(key, None))

    async def resume_outgoing(self, vm: VM, machine: MachineHandle, runner: PodRunner) -> None:
        """An adopted source: re-report a finished migration, finish or roll back one the
        previous agent left running. It never lets both guests run: the switchover needs this
        agent's `migrate-continue` (pause-before-switchover), so a migration QEMU reports
        `completed` passed every check; any other state is cancelled, and QEMU runs the guest
        on here (its disks were never given up)."""
        record = self._record(vm)
        state = record.get("state")
        if state == "failed":
            runner.set_condition(MIGRATION_CONDITION, "False", "Failed", str(record["message"]))
            return
        if state not in ("running", "completed"):
            return
        if isinstance(machine, MigratableDomain):
            await self._follow_domain(vm, machine, runner, record)
            return
        try:
            endpoint = Endpoint.from_json(str(record.get("endpoint")))
        except MigrationError as e:
            self._failed(vm, runner, record, str(e))
            return
        token = str(record.get("token") or "")
        if state == "completed":
            await self._switched_over(vm, machine, runner, endpoint, token, str(record["message"]))
            return
        try:
            monitor = _monitor(machine)
            info = await monitor.execute("query-migrate")
            if info.get("status") == "completed":
                ram = info.get("ram", {})
                message = {
                    "progress": 100,
                    "downtimeMilliseconds": int(info.get("downtime", 0)),
                    "totalMilliseconds": int(info.get("total-time", 0)),
                    "ramBytes": int(ram.get("transferred", 0)),
                    "target": endpoint.target,
                }
                await drop_jobs(monitor, [j for j in await block_jobs(monitor) if "migrate-" in j])
                log.info("%s: the migration completed while no agent ran", vm.uid)
                await self._switched_over(vm, machine, runner, endpoint, token, json.dumps(message))
                return
            if info.get("status") in _ACTIVE:
                await monitor.execute("migrate_cancel")
                for _ in range(200):
                    status = (await monitor.execute("query-migrate")).get("status")
                    if status not in _ACTIVE:
                        break
                    await asyncio.sleep(POLL)
            await drop_jobs(monitor, [j for j in await block_jobs(monitor) if "migrate-" in j])
            for node in await monitor.execute("query-named-block-nodes"):
                if str(node.get("node-name", "")).startswith("migrate-nbd-"):
                    with contextlib.suppress(ExecuteError):
                        await monitor.execute("blockdev-del", {"node-name": node["node-name"]})
            if await monitor.status() != "running":
                await monitor.execute("cont")  # never completed: the guest is this side's
        except (MonitorUnavailable, ExecuteError) as e:
            log.warning("%s: rolling back the interrupted migration: %s", vm.uid, e)
        error = "the source's agent restarted during the migration: cancelled, the VM runs here"
        log.warning("%s: %s", vm.uid, error)
        self._failed(vm, runner, record, error)

    async def _follow_domain(
        self, vm: VM, machine: MachineHandle, runner: PodRunner, record: dict[str, Any]
    ) -> None:
        """An adopted libvirt source in the middle of a migration. Its daemon runs a peer to
        peer migration on when the agent whose call started it dies (found on the lab), so this
        agent follows libvirt's job to its end (`_lvmigrate.follow_outgoing`): the domain moved
        (reported as after the call: the console history to the target, `Completed`, the run
        ends `Migrated`) or it runs on here (`Failed`)."""
        assert isinstance(machine, MigratableDomain)
        try:
            endpoint = Endpoint.from_json(str(record.get("endpoint")))
        except MigrationError as e:
            self._failed(vm, runner, record, str(e))
            return
        try:
            outcome = await machine.follow_migration(self._reporter(runner, endpoint))
        except MigrationError as e:
            error = f"the source's agent restarted during the migration: {e}; the VM runs here"
            log.warning("%s: %s", vm.uid, error)
            self._failed(vm, runner, record, error)
            return
        log.info("%s: libvirt finished the migration the previous agent started", vm.uid)
        message = json.dumps({**json.loads(outcome_message(outcome)), "target": endpoint.target})
        token = str(record.get("token") or "")
        await self._moved(vm, machine, runner, endpoint, token, message)

    async def departed(self, vm: VM) -> None:
        """A libvirt source whose domain was gone from its host when this agent started, in the
        middle of a migration (the record `running`): its daemon may have finished the move
        while no agent ran (it goes on without its client). The target's word (its pod, as
        `_verdict_from_api`) says whether the guest runs there: then the record becomes
        `completed` and the run ends `Migrated` (`ended_while_away`). No word within
        `DEPARTED_WAIT`: the record stays, the run ends `MigrationInterrupted` (never booted
        here again; the controller decides from the target's word)."""
        record = self._record(vm)
        if record.get("state") != "running":
            return
        try:
            endpoint = Endpoint.from_json(str(record.get("endpoint")))
        except MigrationError:
            return
        if endpoint.libvirt is None:
            return  # QEMU's source QEMU ended: its stream cannot have gone on without it
        try:
            verdict = await asyncio.wait_for(self._verdict_from_api(vm, endpoint), DEPARTED_WAIT)
        except TimeoutError:
            return
        if verdict == RUNNING:
            log.info("%s: the domain moved while no agent ran", vm.uid)
            message = json.dumps({"progress": 100, "target": endpoint.target})
            self._write_record(vm, **{**record, "state": "completed", "message": message})

    def ended_while_away(self, vm: VM, runner: PodRunner) -> Terminated | None:
        """The source's QEMU ended while no agent ran, in the middle of a migration: the pod
        never boots it here again (the target may run the guest; the controller decides from
        the target's word), the run ends `Migrated` or `MigrationInterrupted`."""
        record = self._record(vm)
        if record.get("state") == "completed":
            vm.migrated = str(record["message"])
            runner.set_condition(MIGRATION_CONDITION, "True", "Completed", vm.migrated)
            runner.finish()
            return Terminated(0, reason="Migrated", message=vm.migrated)
        if record.get("state") == "running":
            error = "the source QEMU ended during the migration while no agent ran"
            self._failed(vm, runner, record, error)
            runner.finish()
            return Terminated(1, reason="MigrationInterrupted", message=error)
        return None


# -- the rules, from the objects alone -----------------------------------------------------------
def _condition(pod: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == kind:
            return dict(condition)
    return {}


def endpoint_problem(
    endpoint: Endpoint,
    token: str,
    source: str,
    own_node: str,
    target: Mapping[str, Any],
    node: Mapping[str, Any] | None,
) -> str | None:
    """Why `endpoint` (with `token`, on the pod `source`) is not the one a vm node's agent
    published for migrating this pod; None when it is. The target pod's status and its node's
    status are written only by the target node's agent (the Node authorizer, NodeRestriction),
    so a tenant who can annotate their own pod cannot make this agent connect anywhere else."""
    meta = target.get("metadata") or {}
    name = endpoint.pod
    annotations = meta.get("annotations") or {}
    if meta.get("deletionTimestamp"):
        return f"target pod {name} is being deleted"
    if annotations.get(MIGRATION_SOURCE) != source:
        return f"pod {name} is not a migration target of this pod"
    if not hmac.compare_digest(str(annotations.get(MIGRATION_TOKEN, "")).encode(), token.encode()):
        return f"{MIGRATION_TOKEN} is not the one of target pod {name}"
    ready = _condition(target, TARGET_CONDITION)
    published = None
    if ready.get("status") == "True":
        with contextlib.suppress(MigrationError):
            published = Endpoint.from_json(str(ready.get("message")))
    if published != replace(endpoint, max_bandwidth=None):
        return f"the endpoint is not the one target pod {name} published"
    node_name = (node or {}).get("metadata", {}).get("name")
    if node is None or not node_name or node_name != (target.get("spec") or {}).get("nodeName"):
        return f"target pod {name} is on no node"
    if node_name == own_node:
        return f"target pod {name} is on this node"
    status = node.get("status") or {}
    if not any(c.get("type") == VM_NODE_CONDITION for c in status.get("conditions") or []):
        return f"node {node_name} is not a vm node"
    addresses = status.get("addresses") or []
    if endpoint.host not in [a.get("address") for a in addresses if a.get("type") == "InternalIP"]:
        return f"{endpoint.host} is not an InternalIP address of node {node_name}"
    return None


def target_verdict(target: Mapping[str, Any] | None) -> str | None:
    """The target's word on a migration whose stream ended, from its pod (None: the pod is
    gone): `RUNNING`, `failed: <why>` once its QEMU is surely gone, or None (not yet known)."""
    if target is None:
        return "failed: the target pod is gone"
    ready = _condition(target, TARGET_CONDITION)
    if ready.get("reason") == "Completed":
        return RUNNING
    if ready.get("reason") == "Failed":
        return f"failed: {ready.get('message') or 'the target failed'}"
    if (target.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return "failed: the target pod ended"
    return None
