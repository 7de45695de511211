#!/bin/sh
# /sbin/shutdown, poweroff and halt of the small test guest (qemu-ga's guest-shutdown runs
# `shutdown -h -P +0`; busybox's own poweroff would signal PID 1, which is a plain shell here).
echo "vkubelet-guest: shutdown requested" > /dev/console
sync
mount -o remount,ro / 2>/dev/null  # clean on disk: the next boot needs no journal replay
exec busybox poweroff -f
