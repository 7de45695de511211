#!/bin/sh
# PID 1 of vkubelet's small test guest (busybox): /sbin/init of its root file system, on its root
# disk (the initramfs loaded the modules, mounted the root and moved proc, sys and dev into it). It
# reads the vkubelet/ extras of the seed (a NoCloud seed or a ConfigDrive) as data (never eval'd),
# starts the QEMU guest agent and keeps a shell on the serial console.
export PATH=/sbin:/bin
[ -e /proc/mounts ] || mount -t proc proc /proc
[ -d /sys/class ] || mount -t sysfs sys /sys
[ -e /dev/null ] || mount -t devtmpfs dev /dev
mount -t tmpfs -o mode=0755,nosuid,nodev run /run
mkdir -p /dev/pts /tmp /var/log /seed /root
mount -t devpts devpts /dev/pts
log() { echo "vkubelet-guest: $*" > /dev/console; }

ip link set lo up

seed=
for _ in 1 2 3 4 5 6 7 8 9 10; do
    seed=$(findfs LABEL=cidata 2>/dev/null || findfs LABEL=config-2 2>/dev/null) && break
    sleep 0.1
done
if [ -n "$seed" ] && mount -t iso9660 -o ro "$seed" /seed; then
    d=/seed/vkubelet
    if [ -r $d/hostname ]; then
        read -r name < $d/hostname
        case $name in *[!a-zA-Z0-9.-]* | '') log "ignoring invalid hostname" ;;
            *) hostname "$name"; echo "$name" > /etc/hostname ;; esac
    fi
    if [ -r $d/network ]; then
        mac= addr= gw= dns= search=
        while IFS='=' read -r key value; do
            case $key in
                MAC) mac=$value ;; ADDRESS) addr=$value ;; GATEWAY) gw=$value ;;
                DNS) dns="$dns $value" ;; SEARCH) search="$search $value" ;;
            esac
        done < $d/network
        dev=eth0
        for n in /sys/class/net/*; do
            [ "$(cat "$n/address")" = "$mac" ] && dev=${n##*/}
        done
        ip link set "$dev" up
        case $addr in *[!0-9./]* | '') log "ignoring invalid address" ;;
            *) ip addr add "$addr" dev "$dev" ;; esac
        case $gw in *[!0-9.]* | '') ;; *) ip route add default via "$gw" ;; esac
        : > /etc/resolv.conf
        for s in $dns; do
            case $s in *[!0-9a-fA-F.:]*) ;; *) echo "nameserver $s" >> /etc/resolv.conf ;; esac
        done
        domains=
        for s in $search; do
            case $s in *[!a-zA-Z0-9.-]*) ;; *) domains="$domains $s" ;; esac
        done
        [ -n "$domains" ] && echo "search$domains" >> /etc/resolv.conf
    fi
    if [ -d $d/files ]; then
        (cd $d/files && find . -type f) | while read -r f; do
            f=${f#./}
            mkdir -p "/${f%/*}" && cp -p "$d/files/$f" "/$f"
        done
    fi
    if [ -r $d/authorized_keys ]; then
        mkdir -p /root/.ssh && cp $d/authorized_keys /root/.ssh/ && chmod 600 /root/.ssh/*
    fi
else
    log "no seed disk (label cidata or config-2)"
fi

up=$(cut -d' ' -f1 /proc/uptime)
log "booted hostname=$(hostname) uptime=$up"

acpid -c /etc/acpi 2>/dev/null
port=
for p in /sys/class/virtio-ports/*; do
    [ "$(cat "$p/name" 2>/dev/null)" = org.qemu.guest_agent.0 ] && port=/dev/${p##*/}
done
if [ -n "$port" ]; then
    qemu-ga -m virtio-serial -p "$port" -t /run -d
    log "guest agent started on $port uptime=$(cut -d' ' -f1 /proc/uptime)"
else
    log "no guest agent port (org.qemu.guest_agent.0)"
fi

# busybox's own poweroff/halt/reboot applets (what `sh -c poweroff` runs, applets being preferred
# to /sbin) signal PID 1: USR2, USR1, TERM. Handle them like the /sbin scripts.
trap '/sbin/poweroff' USR2 USR1
trap '/sbin/reboot' TERM

# The serial console: a login shell for attach, restarted when it exits. PID 1 only waits (which
# reaps orphans and lets the traps run at once).
console() {
    while :; do setsid -c sh -l <> /dev/ttyS0 >&0 2>&1; done
}
console &
while :; do wait; done
