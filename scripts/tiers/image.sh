#!/usr/bin/env bash
# The image tier: builds ./Dockerfile for real with no Docker daemon (buildah: chroot isolation, no registry),
# runs the image the way the Helm chart runs it, and checks it from outside (tests/deploy/test_image.py, from
# the main venv). Needs root; installs buildah and mmdebstrap with apt-get when they are missing.
#
#   bash scripts/tiers/image.sh [pytest args]        the tier (scripts/test.sh runs it after the main suite)
#   bash scripts/tiers/image.sh build DOCKERFILE TAG  one test build of DOCKERFILE; exits with the build's status
#
# What the test build changes, all through build arguments (the GPU build's defaults stay as they are):
#   CUDA_IMAGE         a local Debian 12 base (registry images can't be pulled here): mmdebstrap minbase with
#                      ca-certificates and this host's own CAs (/usr/local/share/ca-certificates: pip inside
#                      the build meets the same TLS interception as the host), imported into the storage
#   TORCH_INDEX_URL    file:///mnt/simple: a PEP 503 index of CPU torch 2.13.0 and its dependencies (pip
#                      download, on this host: the local wheel), bind-mounted at /mnt for RUN steps only
#                      (/mnt exists in the base, so nothing of it is left in the image)
#   TORCHVISION_VERSION  empty: PyPI only has CUDA builds of torchvision; on the CPU the service preprocesses
#                      with pil
#   WITH_FA4=0         FlashAttention-4 is CUDA only
#   VERSION, VCS_REF   pyproject's version and the commit (+"-dirty" when the image's inputs differ from it)
# and --format docker (what `docker build` writes; the OCI format drops HEALTHCHECK).
#
# Cached under $ENCODER_IMAGE_CACHE (default ~/.cache/encoder-service/image), one run at a time (flock): the
# containers storage (overlay, or vfs where overlay can't mount), the base (keyed by its inputs), the torch
# index, and the image, tagged with a hash of everything it is built from (this script, Dockerfile,
# .dockerignore, pyproject.toml, README.md, encoder_service/, the base, the build arguments but VCS_REF). A
# rerun with nothing changed skips the build and runs the checks; a new build removes the older images.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
START=$SECONDS
CACHE="${ENCODER_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/encoder-service/image}"
MAIN_PY="${ENCODER_MAIN_PYTHON:-$ROOT/.venv/bin/python}"
SUITE=bookworm                     # Debian 12: python3.11, the local torch wheel's Python
MIRROR=http://deb.debian.org/debian
TORCH_SPEC=torch==2.13.0

say() { echo "image tier: $*"; }
fail() { echo "image tier: FAILED: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || fail "needs root (buildah's chroot isolation, mmdebstrap)"
if ! command -v buildah >/dev/null || ! command -v mmdebstrap >/dev/null; then
  say "installing buildah and mmdebstrap (apt-get)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends buildah mmdebstrap >/dev/null
fi
[ -x "$MAIN_PY" ] || scripts/setup.sh test

mkdir -p "$CACHE"
if [ -z "${IMAGE_TIER_LOCKED:-}" ]; then  # a nested `build` (from the tests) runs under its caller's lock
  exec 9>"$CACHE/lock"
  flock 9
  export IMAGE_TIER_LOCKED=1
fi
# Storage: overlay where the kernel mounts one on the cache's filesystem (a layer or a container costs no copy),
# else vfs (a full copy of each: minutes of disk work per run for a 1.5 GB image); $ENCODER_IMAGE_STORAGE
# picks one.
overlay_mounts() {
  local d
  d="$(mktemp -d "$CACHE/overlay-probe.XXXXXX")"
  mkdir "$d/lower" "$d/upper" "$d/work" "$d/merged"
  if mount -t overlay overlay -o "lowerdir=$d/lower,upperdir=$d/upper,workdir=$d/work" "$d/merged" 2>/dev/null; then
    umount "$d/merged"; rm -rf "$d"; return 0
  fi
  rm -rf "$d"; return 1
}
DRIVER="${ENCODER_IMAGE_STORAGE:-}"  # overlay or vfs; empty: overlay where it mounts
if [ -z "$DRIVER" ]; then
  DRIVER=vfs
  overlay_mounts && DRIVER=overlay
fi
printf '[storage]\ndriver = "%s"\ngraphroot = "%s"\nrunroot = "%s"\n' \
  "$DRIVER" "$CACHE/storage-$DRIVER" "$CACHE/run-$DRIVER" > "$CACHE/storage.conf"
export CONTAINERS_STORAGE_CONF="$CACHE/storage.conf" BUILDAH_ISOLATION=chroot

has_image() { buildah inspect --type image "$1" >/dev/null 2>&1; }
key_of() { sha256sum | cut -c1-16; }

# ---- the base: Debian 12 minbase + ca-certificates (+ this host's CAs) ------------------------------------
CAS=(/usr/local/share/ca-certificates/*.crt)
[ -e "${CAS[0]}" ] || CAS=()
MM_ARGS=(--variant=minbase --include=ca-certificates)
if [ "${#CAS[@]}" -gt 0 ]; then
  MM_ARGS+=(--customize-hook='copy-in /usr/local/share/ca-certificates /usr/local/share'
            --customize-hook='chroot "$1" update-ca-certificates >/dev/null 2>&1')
fi
BASE="localhost/encoder-service-testbase:$( { echo "${MM_ARGS[@]}" "$SUITE" "$MIRROR"; cat "${CAS[@]}" /dev/null; } | key_of)"
if ! has_image "$BASE"; then
  t=$SECONDS
  tar="$CACHE/base.tar"
  mmdebstrap -q "${MM_ARGS[@]}" --format=tar "$SUITE" "$tar" "$MIRROR"
  ctr=$(buildah from --pull-never scratch)
  buildah add -q "$ctr" "$tar" / >/dev/null
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd /bin/bash "$ctr"
  buildah commit -q --rm "$ctr" "$BASE" >/dev/null
  rm -f "$tar"
  say "base $BASE made in $((SECONDS - t)) s"
fi

# ---- the torch index ---------------------------------------------------------------------------------------
PIP_TARGET=(--python-version 3.11 --platform manylinux_2_28_x86_64 --only-binary=:all:)
INDEX="$CACHE/torch-index-$(echo "$TORCH_SPEC" "${PIP_TARGET[@]}" | key_of)"
if [ ! -e "$INDEX/.done" ]; then
  rm -rf "$INDEX"
  "$MAIN_PY" -m pip download -q --disable-pip-version-check "${PIP_TARGET[@]}" -d "$INDEX/wheels" "$TORCH_SPEC" \
    2>&1 | { grep -v -E "is ignored: it is neither a file nor a directory" || true; }
  "$MAIN_PY" - "$INDEX" <<'EOF'
import re, sys
from pathlib import Path
index = Path(sys.argv[1])
for wheel in sorted((index / "wheels").glob("*.whl")):
    project = index / "simple" / re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()
    project.mkdir(parents=True, exist_ok=True)
    (project / "index.html").write_text(f'<a href="../../wheels/{wheel.name}">{wheel.name}</a>\n')
EOF
  touch "$INDEX/.done"
fi

# ---- the build -----------------------------------------------------------------------------------------------
VERSION="$("$MAIN_PY" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')"
INPUTS=(Dockerfile .dockerignore pyproject.toml README.md encoder_service)
VCS_REF="$(git rev-parse HEAD)"
[ -z "$(git status --porcelain -- "${INPUTS[@]}")" ] || VCS_REF="$VCS_REF-dirty"
BUILD_ARGS=(--build-arg "CUDA_IMAGE=$BASE" --build-arg TORCH_INDEX_URL=file:///mnt/simple
            --build-arg TORCHVISION_VERSION= --build-arg WITH_FA4=0 --build-arg "VERSION=$VERSION")

build() {  # DOCKERFILE TAG LOG: buildah's exit status (pipefail); the log has its output, each line timed
  buildah bud --isolation chroot --pull-never --format docker --layers=false --force-rm \
    -f "$1" -t "$2" -v "$INDEX:/mnt:ro" "${BUILD_ARGS[@]}" --build-arg "VCS_REF=$VCS_REF" "$ROOT" 2>&1 \
    | while IFS= read -r line; do printf '%(%T)T %s\n' -1 "$line"; done > "$3"
}

if [ "${1:-}" = build ]; then
  [ $# = 3 ] || fail "usage: $0 build DOCKERFILE TAG"
  build "$2" "$3" /dev/stdout
  exit
fi

KEY="$( { cat scripts/tiers/image.sh; echo "$BASE ${INDEX##*/} ${BUILD_ARGS[*]}";
          find "${INPUTS[@]}" -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | sort -z | xargs -0 sha256sum;
        } | key_of)"
IMAGE="localhost/encoder-service:ci-$KEY"
# Containers a killed run left behind (the tests', a build's): this storage is the tier's, used under the lock.
buildah rm --all >/dev/null
if has_image "$IMAGE"; then
  say "image $IMAGE is up to date (built from $(buildah inspect --type image \
    --format '{{index .Docker.Config.Labels "org.opencontainers.image.revision"}}' "$IMAGE"))"
else
  t=$SECONDS
  log="$CACHE/build.log"
  say "building $IMAGE (log: $log)"
  if ! build Dockerfile "$IMAGE" "$log"; then
    tail -n 40 "$log" >&2
    fail "the Dockerfile did not build (last lines above; the whole log: $log)"
  fi
  say "image built in $((SECONDS - t)) s ($DRIVER storage)"
  # Older images and bases.
  buildah images --format '{{.Name}}:{{.Tag}}' \
    | { grep -E '^localhost/encoder-service(-testbase)?:' | grep -v -x -e "$IMAGE" -e "$BASE" || true; } \
    | xargs -r buildah rmi >/dev/null
  buildah rmi --prune >/dev/null 2>&1 || true
fi
say "image size: $(buildah images --format '{{.Size}}' "$IMAGE")"

ENCODER_IMAGE="$IMAGE" "$MAIN_PY" -m pytest -q -ra -p no:cacheprovider tests/deploy/test_image.py "$@"
say "$((SECONDS - START)) s in all"
