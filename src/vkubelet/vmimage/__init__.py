"""Test guests for the vm provider, built from Debian packages (dev tooling, like devcluster).

`build_guest_image()` (also `vkubelet dev vm-image`) gives a small qcow2 guest: Debian's cloud
kernel, a busybox initramfs with the virtio modules and Debian's qemu-ga, reading the NoCloud seed's
`vkubelet/` extras. It boots in a few seconds under TCG, which is what most vm tests need.

`build_distro_image()` (also `vkubelet dev vm-image --distro`) gives a real distribution guest:
Debian bookworm debootstrapped with systemd, cloud-init, qemu-guest-agent and sshd, for the tests
(and users) that need real cloud-init. It boots in about a minute under TCG.
"""

from ._build import (
    GuestImage,
    ImageBuildError,
    build_guest_image,
    cached_image,
    default_cache_dir,
)
from ._distro import build_distro_image, cached_distro_image

__all__ = [
    "GuestImage",
    "ImageBuildError",
    "build_distro_image",
    "build_guest_image",
    "cached_distro_image",
    "cached_image",
    "default_cache_dir",
]
