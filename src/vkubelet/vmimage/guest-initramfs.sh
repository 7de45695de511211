#!/bin/sh
# /init of the small test guest's initramfs (busybox): load the guest's modules (they live here),
# mount the root file system of the root disk, named `root=UUID=...` on the kernel command line,
# and hand over to its /sbin/init. The guest then runs from its disk like any real VM: what it
# writes is there after a power cycle.
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
# PID 1 exiting panics the kernel, which pvpanic reports to QEMU (GUEST_PANICKED): the reason is
# the console's last line.
fail() { echo "vkubelet-guest: $*" > /dev/console; exit 1; }

while read -r mod; do insmod "/lib/modules/$mod.ko" 2>/dev/null; done < /etc/vkubelet-modules
root=
for word in $(cat /proc/cmdline); do
    case $word in root=*) root=${word#root=} ;; esac
done
[ -n "$root" ] || fail "no root= on the kernel command line"
dev=
for _ in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20; do
    dev=$(findfs "$root" 2>/dev/null) && break
    sleep 0.1
done
[ -n "$dev" ] || fail "root file system $root not found"
mount -t ext4 -o noatime "$dev" /newroot || fail "cannot mount the root file system $dev ($root)"
for fs in dev proc sys; do mount --move "/$fs" "/newroot/$fs"; done
exec switch_root /newroot /sbin/init
