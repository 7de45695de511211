"""The provider's `Runtime` on the real parts: QEMU (`_machine`), the pod network (`_net`), the
accelerator probe (`_accel`), the image translator and store (`_translate`, `_store`,
`_disks`) and the seed (`_cloudinit`, `_seed`).

Thin on purpose: each call is the part's own, with the provider's vocabulary. The translation
rules are the config file's plus those of `translationsFile`, re-read when it changes (a
ConfigMap mounted into the agent's pod is such a file; its rules win).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from ._backend import (
    DomainImport,
    GuestAddress,
    LaunchSpec,
    MachineHandle,
    MachineRefused,
    PulledImage,
    RestoreFailed,
)
from ._cloudinit import build_seed_content
from ._config import ConfigError, VMConfig
from ._disks import create_blank, create_overlay, image_info, resize
from ._hotplug import qemu_args
from ._machine import Disk, Machine, MachineSpec
from ._net import BridgedNetwork, GuestNetwork, PodNetwork, pod_dns_search
from ._persist import machine_addresses
from ._seed import write_seed_iso
from ._store import ImageStore, StoredImage
from ._translate import (
    ImageSource,
    ImageTranslator,
    TranslationError,
    TranslationRule,
    parse_rules,
)
from ._volumes import drive_args

__all__ = ["QemuRuntime"]

log = logging.getLogger(__name__)


class QemuRuntime:
    tools: tuple[str, ...] = ("qemu-system-x86_64", "qemu-img")

    def __init__(self, config: VMConfig) -> None:
        self.config = config
        try:
            rules = parse_rules({"translations": config.translations}, origin=config.origin)
        except TranslationError as e:
            raise ConfigError(str(e)) from None
        self._translator = ImageTranslator(config.image_prefix, rules)
        self._overrides_stamp: tuple[int, int] | None = None
        self._file_rules: list[TranslationRule] = []
        self._config_map_rules: list[TranslationRule] = []
        self.store = ImageStore(config.image_store)
        reserved = lambda: machine_addresses(config.state_dir)  # noqa: E731
        self.network: PodNetwork
        if (bridged := config.bridged) is not None:
            self.network = BridgedNetwork(
                bridged.bridge, bridged.subnet, bridged.gateway, bridged.pool, reserved=reserved
            )
        else:
            self.network = PodNetwork(
                config.pod_cidr,
                forward=config.network_mode == "routed",
                shared=config.shared_pod_cidrs,
                reserved=reserved,
            )
        self._networks: dict[str, GuestNetwork] = {}

    def set_translation_overrides(self, data: Mapping[str, Any] | None, origin: str) -> None:
        self._config_map_rules = parse_rules(data, origin=origin) if data else []
        self._apply_overrides()

    def _apply_overrides(self) -> None:
        # The ConfigMap's rules first (its regexps are tried first) and its names win.
        names = {rule.name for rule in self._config_map_rules if rule.name is not None}
        kept = [rule for rule in self._file_rules if rule.name is None or rule.name not in names]
        rules = [*self._config_map_rules, *kept]
        self._translator = self._translator.with_overrides(rules)

    def _current_translator(self) -> ImageTranslator:
        path = self.config.translations_file
        if path is None:
            return self._translator
        try:
            stat = path.stat()
            stamp = (stat.st_mtime_ns, stat.st_size)
        except FileNotFoundError:
            stamp = None
        if stamp != self._overrides_stamp:
            self._overrides_stamp = stamp
            rules = []
            if stamp is not None:
                try:
                    data = yaml.safe_load(path.read_text()) or {}
                    rules = parse_rules(data, origin=str(path))
                except (OSError, yaml.YAMLError, TranslationError) as e:
                    log.warning("translations file %s ignored: %s", path, e)
            self._file_rules = rules
            self._apply_overrides()
        return self._translator

    def translate(self, image: str) -> tuple[str, str | None]:
        source = self._current_translator().translate(image)
        return source.url, source.sha256

    async def pull(
        self, image: str, url: str, sha256: str | None, progress: Callable[[int, int | None], None]
    ) -> PulledImage:
        stored = await self.store.pull(ImageSource(name=image, url=url, sha256=sha256), progress)
        return PulledImage(stored.path, stored.sha256, stored.virtual_size, stored.format)

    async def create_overlay(self, base: PulledImage, path: Path, size: int | None) -> None:
        stored = StoredImage(base.path, base.sha256, base.format, base.size)  # type: ignore[arg-type]
        await create_overlay(stored, path, size=size)

    async def create_blank(self, path: Path, size: int) -> None:
        await create_blank(path, size)

    async def grow_disk(self, path: Path, size: int) -> None:
        if (await image_info(path)).virtual_size < size:
            await resize(path, size)

    def write_seed(
        self,
        path: Path,
        *,
        pod_name: str,
        pod_namespace: str,
        pod_uid: str,
        annotations: Mapping[str, str],
        files: Mapping[str, bytes],
        network_key: str | None,
        secret_files: Collection[str] = (),
    ) -> None:
        network = self._networks.get(network_key) if network_key else None
        if network is not None and self.config.cluster_dns:  # as a kubelet's ClusterFirst
            search = pod_dns_search(pod_namespace, self.config.cluster_domain)
            network = replace(network, dns=self.config.cluster_dns, search=search)
        modes = {name: 0o600 for name in secret_files if name in files}
        content = build_seed_content(pod_name, pod_uid, annotations, files, network, modes=modes)
        iso_modes = {f"vkubelet/files{name}": mode for name, mode in modes.items()}
        write_seed_iso(content, path, file_modes=iso_modes)

    async def attach_network(
        self, key: str, address: str | None = None, *, standby: bool = False
    ) -> GuestAddress:
        return self._attached(key, await self.network.attach(key, address, standby=standby))

    async def claim_network(self, key: str) -> GuestAddress:
        return self._attached(key, await self.network.claim(key))

    def _attached(self, key: str, network: GuestNetwork) -> GuestAddress:
        self._networks[key] = network
        return GuestAddress(
            network.address, self.network.netns(key), network.prefix, network.gateway
        )

    async def detach_network(self, key: str) -> None:
        self._networks.pop(key, None)
        await self.network.detach(key)

    async def launch(self, spec: LaunchSpec) -> MachineHandle:
        if spec.domain is not None:
            await self.check_import(spec.domain)
        if spec.restore is not None:  # (its states are files: `_hibernate`'s -incoming)
            raise RestoreFailed(f"the qemu runtime cannot restore {spec.restore}")
        network = None
        if spec.network_key is not None:
            network = self._networks.get(spec.network_key) or await self.network.attach(
                spec.network_key, spec.network_address, standby=spec.incoming
            )
            self._networks[spec.network_key] = network
        machine = await Machine.launch(
            MachineSpec(
                name=spec.name,
                run_dir=spec.run_dir,
                vcpus=spec.vcpus,
                memory_mib=spec.memory_mib,
                disks=tuple(
                    Disk(path, bus=bus, share_rw=spec.incoming)  # type: ignore[arg-type]
                    for path, bus in spec.disks
                ),
                seed=spec.seed,
                network=network,
                netns=self.network.netns(spec.network_key) if spec.network_key else None,
                accel=spec.accel,
                max_vcpus=spec.max_vcpus,
                max_memory_mib=spec.max_memory_mib,
                memory_slots=spec.memory_slots,
                extra_args=drive_args(spec.claims)
                + spec.extra_args
                + qemu_args(spec.hotplug)
                + (("-incoming", "defer") if spec.incoming else ()),
            )
        )
        return machine

    async def adopt(self, run_dir: Path) -> MachineHandle | None:
        return await Machine.adopt(run_dir)

    async def ping(self) -> None:
        """The tools this runtime runs here: QEMU, and qemu-img (disks are made here)."""
        for tool in self.tools:
            if shutil.which(tool) is None:
                raise RuntimeError(f"{tool} is not installed (Debian: qemu-system-x86 qemu-utils)")

    async def host_resources(self) -> tuple[int, int] | None:
        """None: QEMU runs on this host, whose CPUs and memory the provider reads itself."""
        return None

    async def check_machine(
        self, namespace: str, name: str, pod_uid: str, *, restoring: str | None = None
    ) -> None:
        """Nothing to check: a QEMU machine is the pod's own directory."""

    async def check_import(self, request: DomainImport) -> str:
        raise MachineRefused(
            "UnsupportedByRuntime",
            f"metadata.annotations[vm.vkubelet.io/domain]: importing the domain "
            f"{request.name!r} needs runtime: libvirt (this node runs qemu)",
        )

    async def release_import(self, uuid: str, machine: str, *, delete: bool) -> None:
        """Nothing: this runtime imports no domain."""

    async def probe_accel(self, mode: str) -> tuple[str, str]:
        if mode == "tcg":
            return "tcg", "accel: tcg in the config"
        from ._accel import probe_accel

        choice = await probe_accel(mode)  # type: ignore[arg-type]  # checked by the config
        return choice.accel, choice.reason

    async def discard_saved(self, reference: str) -> None:
        """Nothing: a hibernated QEMU's state is a file of the machine's directory."""

    def gc_images(self, in_use: Collection[str]) -> list[str]:
        return self.store.gc(in_use)
