#!/usr/bin/env bash
# Make a Debian base image for podman without any image registry, from Debian's packages alone: debootstrap a
# minimal bookworm and import it. For machines that reach package registries only (CI's); the CPU image builds on it
# with BASE_IMAGE=local/debian:bookworm. Does nothing when the image is there. Needs root, podman and debootstrap.
#   deploy/podman/debian-base.sh [IMAGE]        (default local/debian:bookworm)
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac
image="${1:-local/debian:bookworm}"
export CONTAINERS_CONF="${CONTAINERS_CONF:-$(cd "$(dirname "$0")" && pwd)/containers.conf}"
if podman image exists "$image"; then
    echo "[debian-base] $image is there"
    exit 0
fi
root="$(mktemp -d /var/tmp/debian-base.XXXXXX)"
trap 'rm -rf "$root"' EXIT
t0=$(date +%s)
echo "[debian-base] debootstrap --variant=minbase bookworm into $root"
debootstrap --variant=minbase bookworm "$root" http://deb.debian.org/debian > "$root.log" 2>&1 \
    || { tail -20 "$root.log"; rm -f "$root.log"; exit 1; }
rm -f "$root.log"
tar -C "$root" -c . | podman import - "$image" > /dev/null
echo "[debian-base] imported $image in $(( $(date +%s) - t0 )) s"
