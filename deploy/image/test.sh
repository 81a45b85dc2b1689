#!/usr/bin/env bash
# `make test-image`: in a container of each image (buildah run, chroot isolation): it runs as uid
# 10001, has no compiler and no pip cache, and
# - recserve:latest reads Parquet, trains (exporting and verifying each dense runtime: TorchScript,
#   ONNX with onnxruntime), serves with the lean frontend and scores (deploy/image/smoke.py);
# - recserve-torchserve:latest has Java 17, trains, then TorchServe's frontend scores through the
#   handler (deploy/image/smoke.py torchserve).
# Then the sizes: the lean image must stay within 1.3 GB.
set -euo pipefail
cd "$(dirname "$0")/../.."
B=(buildah --storage-driver vfs)
LEAN_LIMIT=1300000000  # bytes: issue 55's bound on recserve:latest

check() {  # IMAGE [smoke.py's arguments]
  local image=$1 ctr
  shift
  echo "== $image"
  ctr=$("${B[@]}" from "$image")
  trap '"${B[@]}" rm "$ctr" >/dev/null' RETURN
  inside() { "${B[@]}" run --isolation chroot -v "$PWD/deploy/image/smoke.py:/smoke.py:ro" "$ctr" -- "$@"; }
  [ "$(inside id -u)" = 10001 ] || { echo "$image does not run as uid 10001" >&2; exit 1; }
  inside sh -c '! command -v gcc && ! command -v cc && ! test -e /root/.cache/pip && ! test -e /tmp/.cache/pip' \
    || { echo "$image has a compiler or a pip cache" >&2; exit 1; }
  inside python3 /smoke.py "$@"
}

check recserve:latest
check recserve-torchserve:latest torchserve
# buildah's figure ("1.13 GB": decimal units) in bytes, against the bound
bytes() { "${B[@]}" images --format '{{.Size}}' "$1" | awk '{m = $2 == "GB" ? 1e9 : $2 == "MB" ? 1e6 : $2 == "kB" ? 1e3 : 1; printf "%d", $1 * m}'; }
lean=$(bytes recserve:latest)
echo "images ok: recserve:latest $("${B[@]}" images --format '{{.Size}}' recserve:latest)," \
  "recserve-torchserve:latest $("${B[@]}" images --format '{{.Size}}' recserve-torchserve:latest)"
[ "$lean" -le "$LEAN_LIMIT" ] || { echo "recserve:latest is $lean bytes, over the $LEAN_LIMIT bound" >&2; exit 1; }
