"""Test guests for the vm provider, built from Debian packages (dev tooling, like devcluster).

`build_guest_image()` (also `vkubelet dev vm-image`) gives a small qcow2 guest: Debian's cloud
kernel, a busybox initramfs with the virtio modules and Debian's qemu-ga, reading the NoCloud seed's
`vkubelet/` extras. It boots in a few seconds under TCG, which is what most vm tests need.
"""

from ._build import (
    GuestImage,
    ImageBuildError,
    build_guest_image,
    cached_image,
    default_cache_dir,
)

__all__ = [
    "GuestImage",
    "ImageBuildError",
    "build_guest_image",
    "cached_image",
    "default_cache_dir",
]
