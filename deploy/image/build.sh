#!/usr/bin/env bash
# `make image`: the recserve OCI image, built with buildah from Debian's packages (nothing is pulled
# from a container registry): a bookworm base made by debootstrap (python3 only: the image's roles
# are the Kubernetes manifests', none runs TorchServe, so neither it nor Java is in it), then
# deploy/image/Containerfile installs recserve and its dependencies from wheels built here by pip
# (torch pinned to the CPU wheel). Tags recserve:latest in buildah's vfs storage.
# With --torchserve (`make image-torchserve`) it builds recserve-torchserve:latest instead: the lean
# image as it is plus Java 17 and TorchServe (deploy/image/Containerfile.torchserve), for
# deploy/kubernetes/components/torchserve; recserve:latest must be built first.
#   deploy/image/build.sh [--rebuild-base | --torchserve]
set -euo pipefail
cd "$(dirname "$0")/../.."
B=(buildah --storage-driver vfs)
PACKAGES=python3,python3-venv,ca-certificates
# The base's tag names its package list: a base made from another list is never reused.
BASE=localhost/recserve-base:bookworm-$(printf %s "$PACKAGES" | sha256sum | cut -c1-12)
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PY=${PY:-.venv/bin/python}

for tool in buildah debootstrap strip readelf; do
  command -v "$tool" >/dev/null || { echo "make image needs $tool: apt-get install buildah debootstrap binutils" >&2; exit 2; }
done
[ "$(id -u)" = 0 ] || { echo "make image needs root (debootstrap, buildah's vfs storage)" >&2; exit 2; }
mkdir -p build  # the logs and the wheels land here (gitignored: absent on a fresh clone)

wheels() {  # the wheels of recserve (with the extras asked for) and its dependencies, and pip's
  echo "== wheels: $*"
  rm -rf build/image/wheels
  "$PY" -m pip wheel -q --wheel-dir build/image/wheels "$@"
}

if [ "${1:-}" = --torchserve ]; then
  "${B[@]}" inspect --type image recserve:latest >/dev/null 2>&1 \
    || { echo "make image-torchserve builds on recserve:latest: run make image first" >&2; exit 2; }
  wheels '.[serve]' pip
  echo "== image: recserve-torchserve:latest (recserve:latest + Java 17 + TorchServe)"
  "${B[@]}" bud --isolation chroot --layers=false --build-arg LEAN=localhost/recserve:latest \
    -f deploy/image/Containerfile.torchserve -t recserve-torchserve:latest .
  "${B[@]}" images --format '{{.Name}}:{{.Tag}} {{.Size}}' recserve-torchserve:latest
  exit 0
fi

if [ "${1:-}" = --rebuild-base ] || ! "${B[@]}" inspect --type image "$BASE" >/dev/null 2>&1; then
  echo "== base: debootstrap bookworm ($PACKAGES) from $MIRROR"
  ctr=$("${B[@]}" from scratch)
  trap '"${B[@]}" rm "$ctr" >/dev/null 2>&1 || true' EXIT
  mnt=$("${B[@]}" mount "$ctr")
  debootstrap --variant=minbase --include="$PACKAGES" \
    bookworm "$mnt" "$MIRROR" >build/debootstrap.log 2>&1 || { tail -20 build/debootstrap.log >&2; exit 1; }
  rm -rf "$mnt"/var/lib/apt/lists/* "$mnt"/var/cache/apt/archives/*.deb "$mnt"/var/log/*.log \
    "$mnt"/usr/share/doc/* "$mnt"/usr/share/man/* "$mnt"/usr/share/info/* "$mnt"/usr/share/locale/*
  "${B[@]}" unmount "$ctr"
  "${B[@]}" commit --rm "$ctr" "$BASE"
  trap - EXIT
fi

wheels .

echo "== image: recserve:latest"
"${B[@]}" bud --isolation chroot --layers=false --build-arg BASE="$BASE" -f deploy/image/Containerfile -t recserve:latest .

echo "== strip the shared libraries' symbol tables (this host's binutils: none of it goes in the image)"
unstripped=$("${B[@]}" images -q recserve:latest)
ctr=$("${B[@]}" from recserve:latest)
trap '"${B[@]}" rm "$ctr" >/dev/null 2>&1 || true' EXIT
mnt=$("${B[@]}" mount "$ctr")
# Not the libraries auditwheel vendored (<pkg>.libs/) nor those it pointed at them (RPATH ...libs):
# patchelf rewrote their headers, and stripping them leaves segments a loader refuses ("ELF load
# command address/offset not page-aligned"). A file named like a library that is not ELF is left too.
find "$mnt/opt/recserve" -type f -name '*.so*' -not -path '*.libs/*' -print0 |
  while IFS= read -r -d '' lib; do
    readelf -d "$lib" 2>/dev/null | grep -q 'R.*PATH.*\.libs' || strip --strip-unneeded "$lib" 2>/dev/null || true
  done
"${B[@]}" unmount "$ctr"
"${B[@]}" commit --rm --squash "$ctr" recserve:latest
trap - EXIT
"${B[@]}" rmi "$unstripped" >/dev/null  # the image before stripping, untagged by the commit
"${B[@]}" images --format '{{.Name}}:{{.Tag}} {{.Size}}' recserve:latest
