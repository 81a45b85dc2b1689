#!/usr/bin/env bash
# `make test-image`: in a container of recserve:latest (buildah run, chroot isolation): it runs as
# uid 10001, has no compiler and no pip cache, and reads Parquet, trains (exporting and verifying
# each dense runtime: TorchScript, ONNX with onnxruntime), serves and scores (deploy/image/smoke.py).
set -euo pipefail
cd "$(dirname "$0")/../.."
B=(buildah --storage-driver vfs)
ctr=$("${B[@]}" from recserve:latest)
trap '"${B[@]}" rm "$ctr" >/dev/null' EXIT
inside() { "${B[@]}" run --isolation chroot -v "$PWD/deploy/image/smoke.py:/smoke.py:ro" "$ctr" -- "$@"; }
[ "$(inside id -u)" = 10001 ] || { echo "the image does not run as uid 10001" >&2; exit 1; }
inside sh -c '! command -v gcc && ! command -v cc && ! test -e /root/.cache/pip && ! test -e /tmp/.cache/pip' \
  || { echo "the image has a compiler or a pip cache" >&2; exit 1; }
inside python3 /smoke.py
echo "image ok: $("${B[@]}" images --format '{{.Size}}' recserve:latest)"
