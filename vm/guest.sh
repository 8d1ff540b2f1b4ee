#!/bin/sh
# Runs inside the VM (virtme-ng boots the host's root read-only over 9p, the checkout read-write).
# Usage: guest.sh RUN_DIR, where RUN_DIR/run.env says what to run. The exit code goes to
# RUN_DIR/exit-code because virtme-ng's own exit status is not reliable (255 without udev).
RUN_DIR=$1
set -a  # every setting reaches pytest and the tests (JUKEBOX_TEST_SLOWDOWN)
. "$RUN_DIR/run.env"
set +a
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
exec >"$RUN_DIR/guest.log" 2>&1
echo "guest: kernel $(uname -r)"

# fuse and overlay come from the guest kernel's own modules (built in on newer kernels, where
# modprobe succeeds anyway); a module that will not load is reported, and the tests that need it
# skip with their own reason.
for mod in fuse overlay ext4; do
    if modprobe "$mod"; then echo "guest: module $mod ok"; else echo "guest: module $mod MISSING"; fi
done

# A fresh ext4 scratch disk as /tmp: pytest's trees, stores and tapes live there (9p is not a
# file system the booth is tested on, and the default in-RAM /tmp fills up on big commits).
scratch=$(blkid -L jbx-scratch)
mount -t ext4 "$scratch" /tmp && chmod 1777 /tmp || { echo "guest: no scratch disk"; echo 97 >"$RUN_DIR/exit-code"; exit 97; }
mkdir -p /tmp/home && export HOME=/tmp/home

# virtme-ng gives /etc, /srv, /var and the like a writable overlay but leaves /root read-only; the
# escape tests plant a canary there (a host file the booth must not reach), so it gets a tmpfs
# (first: the interpreter below may live under /root, and is bind-mounted onto it).
mount -t tmpfs -o mode=0700 jbx-root /root && echo "guest: /root on a tmpfs"

# The interpreter and the checkout's venv from an ext4 image, at the paths they have on the
# host: importing the suite's packages over 9p takes three times as long.
py=$(blkid -L jbx-python)
if [ -n "$py" ] && mkdir -p /run/jbx-python && mount -t ext4 -o ro "$py" /run/jbx-python; then
    [ -d /run/jbx-python/venv ] && mount --bind /run/jbx-python/venv "$JBX_VENV"
    [ -d /run/jbx-python/prefix ] && mkdir -p "$JBX_PREFIX" && mount --bind /run/jbx-python/prefix "$JBX_PREFIX"
    echo "guest: python from the image"
else
    echo "guest: python over 9p (no image)"
fi

# cgroup v2, as a systemd host has it: the booth's limits and freezer tests need it.
mountpoint -q /sys/fs/cgroup || mount -t cgroup2 none /sys/fs/cgroup

# Only the timeout plugin: the langsmith and hypothesis plugins cost seconds of emulated start-up.
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 PYTHONUNBUFFERED=1  # unbuffered: guest.log shows progress
cd "$JBX_REPO" || exit 98
echo "guest: $("$JBX_VENV/bin/python" -m vm.fuse_probe 2>&1 | tail -1)"
echo "guest: pytest starts $(date -u +%T)"
# A budget (seconds) interrupts pytest as Ctrl-C would: it stops after the test it is in, and
# still writes the JUnit XML, so a slow machine reports what it got through instead of nothing.
budget=""
[ "${JBX_BUDGET:-0}" -gt 0 ] && budget="timeout -s INT -k 120 $JBX_BUDGET"
# shellcheck disable=SC2086  # JBX_TESTS is a list of test ids
$budget "$JBX_VENV/bin/python" -m pytest -p pytest_timeout -p no:cacheprovider -q -rfEs --basetemp=/tmp/pytest \
    --timeout="$JBX_PYTEST_TIMEOUT" --junitxml="$RUN_DIR/junit.xml" $JBX_PYTEST_ARGS $JBX_TESTS
rc=$?
[ -n "$budget" ] && [ "$rc" -eq 124 ] && echo "guest: budget of $JBX_BUDGET s ran out"
echo "guest: pytest ended $(date -u +%T) with $rc"
echo "$rc" >"$RUN_DIR/exit-code"
sync
exit "$rc"
