"""The container image definition (deploy/image) pins everything it installs.

No registry is reachable here, so the image is not built in tests: the Containerfile is parsed
with Docker's own parser (PyPI `dockerfile` wraps moby/buildkit's) and held to what makes a build
reproducible, offline. `make image-check` also downloads every locked file from PyPI by hash.
"""

from __future__ import annotations

import importlib.util
import re
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import dockerfile
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

IMAGE = Path(__file__).resolve().parents[2] / "deploy" / "image"
CONTAINERFILE = (IMAGE / "Containerfile").read_text()
INSTRUCTIONS = dockerfile.parse_string(CONTAINERFILE)


def instructions(cmd: str) -> list[tuple[str, ...]]:
    return [i.value for i in INSTRUCTIONS if i.cmd.upper() == cmd]


def locked(path: Path) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, hashes) of a pip-compile --generate-hashes lock."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())  # join continuation lines
    entries: dict[str, tuple[str, list[str]]] = {}
    for line in text.splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9._-]+)==(\S+)((?:\s+--hash=sha256:[0-9a-f]{64})+)", line)
        assert match, f"{path.name}: not pinned with hashes: {line}"
        hashes = re.findall(r"sha256:([0-9a-f]{64})", match.group(3))
        entries[canonicalize_name(match.group(1))] = (match.group(2), hashes)
    return entries


def runtime_closure(name: str, seen: set[str] | None = None) -> set[str]:
    """The installed distribution's dependencies, transitively, without extras' own."""
    seen = set() if seen is None else seen
    key = canonicalize_name(name)
    if key in seen:
        return seen
    seen.add(key)
    try:
        requires = distribution(name).requires or []
    except PackageNotFoundError:
        return seen
    for text in requires:
        requirement = Requirement(text)
        if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
            continue
        runtime_closure(requirement.name, seen)
        for extra in requirement.extras:  # httpx2[http2]
            for extra_text in distribution(requirement.name).requires or []:
                dep = Requirement(extra_text)
                if dep.marker and dep.marker.evaluate({"extra": extra}):
                    runtime_closure(dep.name, seen)
    return seen


def test_the_base_image_is_pinned_by_digest() -> None:
    (base,) = [v[0] for v in instructions("ARG") if v[0].startswith("BASE=")]
    assert re.search(r"@sha256:[0-9a-f]{64}$", base), base
    stages: set[str] = set()
    for image, *alias in instructions("FROM"):
        assert image == "${BASE}" or image in stages, f"FROM {image}: not the pinned base"
        stages.update(alias[1:])  # ("AS", name)
    assert stages == {"build", "agent", "vm", "libvirt-build", "libvirt"}


def test_every_dependency_is_installed_from_a_lock_with_hashes() -> None:
    runs = " && ".join(v[0] for v in instructions("RUN"))
    installs = re.findall(r"bin/pip install ([^&]+)", runs)
    assert len(installs) == 5
    for args in installs:
        assert "--no-deps" in args, args
        # A lock, hash-checked; or the wheel just built from this tree; or the libvirt binding's
        # sdist, downloaded by hash and unpacked (a fixed build directory, see below).
        built = ("/wheels/vkubelet-*.whl", "/src/libvirt-python")
        assert "--require-hashes" in args or args.strip().endswith(built), args
    downloads = re.findall(r"bin/pip download ([^&]+)", runs)
    assert [d.split()[-1] for d in downloads] == ["/locks/libvirt-requirements.lock"]
    assert "--require-hashes" in downloads[0]
    vm = INSTRUCTIONS[next(i for i, x in enumerate(INSTRUCTIONS) if x.value[-1] == "vm") :]
    before_vm = INSTRUCTIONS[: len(INSTRUCTIONS) - len(vm)]
    assert not any("apt-get" in x.value[0] for x in before_vm if x.cmd.upper() == "RUN")
    # The vm and libvirt stages' packages: from one dated snapshot unless the builder names
    # another mirror.
    mirrors = {x.value[0] for x in vm if x.cmd.upper() == "ARG"}
    (mirror,) = mirrors
    snapshot = r"http://snapshot\.debian\.org/archive/debian/\d{8}T\d{6}Z"
    assert re.fullmatch(f"DEBIAN_MIRROR={snapshot}", mirror), mirror
    assert locked(IMAGE / "requirements.lock")
    assert "hatchling" in locked(IMAGE / "build-requirements.lock")
    assert "setuptools" in locked(IMAGE / "libvirt-build-requirements.lock")


def test_the_libvirt_target_carries_the_extras_binding_ssh_and_qemu_img_only() -> None:
    """The chart's vm mode: libvirt-python at the version pyproject.toml's `libvirt` extra pins,
    from its one sdist by hash (it has no wheels); libvirt0, ssh and qemu-img; no QEMU; the
    chart's user named in /etc/passwd, which ssh needs."""
    pyproject = (IMAGE.parents[1] / "pyproject.toml").read_text()
    (pinned,) = re.findall(r'"libvirt-python==([^"]+)"', pyproject)
    ((version, hashes),) = locked(IMAGE / "libvirt-requirements.lock").values()
    assert (version, len(hashes)) == (pinned, 1)
    at = next(i for i, x in enumerate(INSTRUCTIONS) if x.value[-1] == "libvirt")
    stage = INSTRUCTIONS[
        at : next(
            i for i in range(at + 1, len(INSTRUCTIONS)) if INSTRUCTIONS[i].cmd.upper() == "FROM"
        )
    ]
    runs = " ".join(x.value[0] for x in stage if x.cmd.upper() == "RUN")
    packages = re.search(r"apt-get install -y --no-install-recommends ([^&]+)", runs)
    assert packages and packages.group(1).split() == ["libvirt0", "openssh-client", "qemu-utils"]
    assert [x.value for x in stage if x.cmd.upper() == "USER"][-1] == ("65532:65532",)
    # ssh refuses a uid that /etc/passwd does not name.
    assert '"nonroot:x:65532:65532:nonroot:' in runs


def test_the_agent_runs_as_the_charts_unprivileged_user() -> None:
    agent = INSTRUCTIONS[: next(i for i, x in enumerate(INSTRUCTIONS) if x.value[-1] == "vm")]
    (user,) = [x.value[0] for x in agent if x.cmd.upper() == "USER"]
    assert user == "65532:65532"
    values = yaml.safe_load((IMAGE.parent / "helm" / "vkubelet" / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == 65532
    assert instructions("ENTRYPOINT") == [("/opt/vkubelet/bin/vkubelet",)]


def test_the_lock_holds_exactly_the_agents_runtime_dependencies() -> None:
    lock = set(locked(IMAGE / "requirements.lock"))
    needed = runtime_closure("vkubelet") - {"vkubelet"}
    assert needed - lock == set(), (
        "missing from requirements.lock: run pip-compile (docs/deploy.md)"
    )
    assert lock - needed == set(), "requirements.lock holds packages vkubelet does not need"


def test_the_build_is_stamped_with_source_date_epoch() -> None:
    assert ("SOURCE_DATE_EPOCH=0",) in instructions("ARG")
    assert any(
        "SOURCE_DATE_EPOCH" in v and "${SOURCE_DATE_EPOCH}" in v for v in instructions("ENV")
    )
    assert "--invalidation-mode checked-hash" in CONTAINERFILE  # no mtimes in .pyc files


def test_the_local_base_is_only_the_root_file_system_tar() -> None:
    """The offline base (deploy/image/build.py base): nothing in it but the debootstrap tree."""
    base = dockerfile.parse_string((IMAGE / "debian-base.Containerfile").read_text())
    assert [(i.cmd.upper(), i.value) for i in base][:2] == [
        ("FROM", ("scratch",)),
        ("ADD", ("rootfs.tar", "/")),
    ]
    assert not [i for i in base if i.cmd.upper() == "RUN"]


def test_the_build_script_stamps_layers_and_wheel_with_one_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--timestamp` (file times, config, history) and SOURCE_DATE_EPOCH (wheel, bytecode) must
    be the same number, and the proxy's CA bundle may reach the RUN steps only as a mount."""
    spec = importlib.util.spec_from_file_location("image_build", IMAGE / "build.py")
    assert spec and spec.loader
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    calls: list[list[str]] = []
    monkeypatch.setattr(script, "run", lambda argv, **_: calls.append(argv))
    monkeypatch.setattr(script, "identity", lambda tag: {"tag": tag})
    monkeypatch.setenv("VKUBELET_IMAGE_CA_BUNDLE", "/etc/ssl/certs/ca-certificates.crt")
    script.build(script.LOCAL_BASE, "agent", "t", 1795549145, None, True)
    (argv,) = calls
    assert "--timestamp=1795549145" in argv
    assert argv[argv.index("SOURCE_DATE_EPOCH=1795549145") - 1] == "--build-arg"
    assert f"BASE={script.LOCAL_BASE}" in argv
    assert "--no-cache" in argv
    mount = "--volume=/etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro"
    assert mount in argv
