#!/usr/bin/env bash
# `make compose-check`: compose.yaml run for real with podman on a host without a registry or a compose engine.
#   1. base    a Debian rootfs (debootstrap, python3 from Debian's packages), imported as an image; cached: built
#              again only when this script's package list changes (or COMPOSE_CHECK_REBUILD_BASE=1)
#   2. images  the project's image from the Dockerfile on that base (the CPU torch wheel from the host's pip
#              find-links folder), and stand-ins for compose.yaml's redis:7 and postgres:15 from Debian's packages
#   3. up      redis, postgres, migrate, api and pool-cpu (profile cpu, the tiny preset) in a pod (compose_pod.py)
#   4. train   a tenant trains through the Tinker SDK while the pool container is SIGKILLed twice (train_check.py)
#   5. down    the pod, its containers and volumes removed (also when a phase fails)
# Needs root (podman, debootstrap) and PYTHON, a Python with the project's dev dependencies (the Tinker SDK, PyYAML).
# Prints each phase's wall time; exits non-zero on the first failure.
set -euo pipefail
cd "$(dirname "$0")/../.."
HERE=scripts/compose_check
PYTHON=${PYTHON:-.venv/bin/python}
PROJECT=${COMPOSE_CHECK_PROJECT:-loraplex-check}
PORT=${COMPOSE_CHECK_PORT:-18700}
SUITE=bookworm
MIRROR=${COMPOSE_CHECK_MIRROR:-http://deb.debian.org/debian}
BASE_PACKAGES=python3,python3-venv,ca-certificates
BASE=localhost/loraplex-base:$SUITE-$(printf '%s' "$SUITE $BASE_PACKAGES" | sha256sum | cut -c1-12)
TAG=compose-check
# The host's folder of wheels (its pip find-links: the CPU torch wheel lies there) and CA bundle (pip behind a
# TLS-inspecting proxy), mounted into the image build; without them the Dockerfile's defaults reach the public indexes.
WHEELS=${COMPOSE_CHECK_WHEELS:-${PIP_FIND_LINKS:-}}
CA_BUNDLE=${COMPOSE_CHECK_CA_BUNDLE:-${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}}
export CONTAINERS_CONF=$PWD/$HERE/containers.conf  # ulimits and runc for these hosts; the host's files untouched

phases=()
timed() {
  local name=$1 start=$SECONDS
  shift
  "$@"
  phases+=("$(printf '%-7s %4d s' "$name" $((SECONDS - start)))")
}
report() {
  local rc=${1:-$?}  # the script's exit status
  printf 'compose-check phase: %s\n' "${phases[@]}"
  if [ "$rc" = 0 ]; then echo "compose-check: passed in $SECONDS s"; else echo "compose-check: FAILED (exit $rc) after $SECONDS s"; fi
}

tools() {
  local missing=()
  for tool in podman runc debootstrap; do command -v "$tool" >/dev/null || missing+=("$tool"); done
  if [ ${#missing[@]} -gt 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc debootstrap >/dev/null
  fi
  "$PYTHON" -c "import tinker, yaml" || { echo "compose-check: $PYTHON lacks the Tinker SDK or PyYAML (make setup)"; exit 1; }
}

base_image() {
  if [ "${COMPOSE_CHECK_REBUILD_BASE:-0}" != 1 ] && podman image exists "$BASE"; then
    echo "base image $BASE (cached)"
    return
  fi
  local root
  root=$(mktemp -d /var/tmp/loraplex-rootfs.XXXXXX)
  debootstrap --variant=minbase --include="$BASE_PACKAGES" "$SUITE" "$root" "$MIRROR" >"$root.log" 2>&1 \
    || { tail -20 "$root.log"; rm -rf "$root" "$root.log"; return 1; }
  rm -rf "$root"/var/cache/apt/archives/*.deb
  tar -C "$root" -c . | podman import --quiet --change 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
  rm -rf "$root" "$root.log"
  echo "base image $BASE built"
}

build() {  # podman build, its output shown only when it fails
  local log
  log=$(mktemp /var/tmp/loraplex-build.XXXXXX)
  podman build "$@" >"$log" 2>&1 || { tail -40 "$log"; rm -f "$log"; return 1; }
  rm -f "$log"
}

images() {
  local mounts=() args=()
  if [ -n "$WHEELS" ] && [ -d "$WHEELS" ]; then
    mounts+=(-v "$WHEELS:/wheels:ro")
    args+=(--build-arg WHEELS=/wheels --build-arg TORCH_INDEX_URL=https://pypi.org/simple)
  fi
  if [ -f "$CA_BUNDLE" ]; then mounts+=(-v "$CA_BUNDLE:/ca-bundle.crt:ro"); args+=(--build-arg CA_BUNDLE=/ca-bundle.crt); fi
  build -f Dockerfile -t "loraplex:$TAG" --build-arg BASE_IMAGE="$BASE" "${args[@]}" "${mounts[@]}" .
  for service in redis postgres; do
    build -f "$HERE/stand-ins/$service.Containerfile" -t "localhost/compose-check-$service:$TAG" \
      --build-arg BASE_IMAGE="$BASE" "$HERE/stand-ins"
  done
  # The CPU build of torch, whichever index served it (a CUDA wheel would be gigabytes and useless here).
  podman run --rm "loraplex:$TAG" python -c \
    "import torch; assert torch.version.cuda is None, torch.__version__; print('image torch', torch.__version__)"
}

# compose.yaml's variables for this run (compose reads them from the environment as from .env).
export COMPOSE_PROFILES=cpu IMAGE_TAG=$TAG API_PORTS=$PORT LORAPLEX_BASE_MODEL=tiny LORAPLEX_POOL=default \
  POSTGRES_USER=loraplex POSTGRES_PASSWORD=compose-check POSTGRES_DB=loraplex LORAPLEX_API_WORKERS=1
pod() {
  "$PYTHON" "$HERE/compose_pod.py" --project "$PROJECT" \
    --image "redis:7=localhost/compose-check-redis:$TAG" --image "postgres:15=localhost/compose-check-postgres:$TAG" "$@"
}
down() { pod down; }
finish() {  # on exit after `up` began: the stack comes down whatever happened, then the report
  local rc=$?
  if [ "${COMPOSE_CHECK_KEEP:-0}" != 1 ]; then pod down >/dev/null 2>&1 || true; fi
  report "$rc"
}

trap report EXIT
timed tools tools
timed base base_image
timed images images
down >/dev/null 2>&1 || true  # what an interrupted run left
trap finish EXIT
timed up pod up --wait api pool-cpu
timed train "$PYTHON" "$HERE/train_check.py" --project "$PROJECT" --base-url "http://127.0.0.1:$PORT"
timed down down
trap report EXIT
