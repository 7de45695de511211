"""Test guests for the vm provider, built from Debian packages (dev tooling, like devcluster).

`build_guest_image()` (also `vkubelet dev vm-image`) gives a small qcow2 guest: Debian's cloud
kernel, a busybox initramfs with the virtio modules that mounts the ext4 root of the disk (busybox,
Debian's qemu-ga), reading the NoCloud seed's `vkubelet/` extras. What it writes stays on its disk,
as in any real VM; it boots in a few seconds under TCG, which is what most vm tests need.
`build_distro_image()` (`vkubelet dev vm-image --distro`) gives a debootstrapped Debian with
systemd, cloud-init and qemu-guest-agent: slow, for the tests that need a real cloud-init.
"""

from ._build import (
    GuestImage,
    ImageBuildError,
    build_guest_image,
    cached_image,
    default_cache_dir,
)
from ._distro import build_distro_image

__all__ = [
    "GuestImage",
    "ImageBuildError",
    "build_distro_image",
    "build_guest_image",
    "cached_image",
    "default_cache_dir",
]
