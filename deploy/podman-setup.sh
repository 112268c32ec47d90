#!/usr/bin/env bash
# Set up rootful podman for deploy/compose-test.sh on a Debian 12 machine that has no Docker engine and whose
# containers reach no registry: podman, runc, netavark, docker-compose v1 (to validate docker-compose.yml) and
# podman-compose 1.6.0 in a venv at $LAB_DIR/pcvenv, plus local stand-ins for the two base images the compose
# file names (python:3.11-slim, prom/prometheus) built from a debootstrapped Debian. Idempotent; as root; about
# 90 s on a fresh machine.
#
#   LAB_DIR   where podman-compose's venv and the build files go (default /var/tmp/peerd-lab)
#
# What the compose file and Dockerfile live with there: runc (crun refuses a cgroup v1+v2 hybrid), ulimits
# within the machine's hard limits, wheels fetched on the host into deploy/wheels/ (PEERD_INSTALL_FROM=wheels),
# Debian's Prometheus 2.42 (prometheus.yml keeps to what it parses).
set -euo pipefail
WORK=${LAB_DIR:-/var/tmp/peerd-lab}
mkdir -p "$WORK"
export DEBIAN_FRONTEND=noninteractive
t0=$SECONDS; step() { echo "[$((SECONDS - t0))s] == $*"; }

# Debian mirror = the one apt already uses on this machine
SRC=/etc/apt/sources.list.d/debian.sources
MIRROR=$(sed -n 's/^URIs: *//p' "$SRC" | grep -v security | head -1)
SECMIRROR=$(sed -n 's/^URIs: *//p' "$SRC" | grep security | head -1)
: "${MIRROR:?no Debian mirror found in $SRC}"

step "apt packages"
timeout 300 apt-get update -q >/dev/null
timeout 600 apt-get install -y -q --no-install-recommends \
    podman runc netavark aardvark-dns catatonit iptables debootstrap docker-compose >/dev/null

step "podman config: runc (crun refuses cgroup v1+v2 hybrid), ulimits within the VM's hard limits"
mkdir -p /etc/containers
cat > /etc/containers/containers.conf <<EOF
[containers]
default_ulimits = ["nofile=$(ulimit -Hn):$(ulimit -Hn)", "nproc=32768:32768"]
[engine]
runtime = "runc"
[network]
network_backend = "netavark"
EOF
timeout 60 podman info --format '{{.Host.OCIRuntime.Name}} {{.Host.NetworkBackend}} {{.Store.GraphDriverName}} cgroup{{.Host.CgroupsVersion}}'

step "podman-compose 1.6.0 from PyPI (Debian's 1.0.3 ignores replicas/--scale)"
timeout 120 python3 -m venv "$WORK/pcvenv"
timeout 300 "$WORK/pcvenv/bin/pip" install -q podman-compose==1.6.0 2>&1 | grep -v 'is ignored: it is neither' || true

if ! podman image exists localhost/debian-base:bookworm; then
  step "debootstrap minbase bookworm from $MIRROR"
  rm -rf "$WORK/rootfs"
  timeout 600 debootstrap --variant=minbase bookworm "$WORK/rootfs" "$MIRROR" >"$WORK/debootstrap.log"
  {
    echo "deb $MIRROR bookworm main"
    echo "deb $MIRROR bookworm-updates main"
    [ -n "$SECMIRROR" ] && echo "deb $SECMIRROR bookworm-security main"
  } >"$WORK/rootfs/etc/apt/sources.list"
  cat >"$WORK/rootfs/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
  rm -rf "$WORK"/rootfs/var/lib/apt/lists/* "$WORK"/rootfs/var/cache/apt/*.bin "$WORK"/rootfs/var/cache/apt/archives/*.deb
  step "podman import"
  tar -C "$WORK/rootfs" -c . | timeout 300 podman import --change 'CMD ["/bin/bash"]' - localhost/debian-base:bookworm >/dev/null
  rm -rf "$WORK/rootfs"
fi

step "python:3.11-slim stand-in (Debian python3 3.11.2, pip, venv)"
mkdir -p "$WORK/img-python"
cat >"$WORK/img-python/Containerfile" <<'EOF'
FROM localhost/debian-base:bookworm
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-pip python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && ln -s /usr/bin/python3 /usr/local/bin/python && ln -s /usr/bin/pip3 /usr/local/bin/pip \
 && rm -f /usr/lib/python3.11/EXTERNALLY-MANAGED
ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1
CMD ["python3"]
EOF
timeout 600 podman build -q -t localhost/python:3.11-slim "$WORK/img-python" >/dev/null
podman tag localhost/python:3.11-slim docker.io/library/python:3.11-slim

step "prom/prometheus stand-in (Debian prometheus 2.42)"
mkdir -p "$WORK/img-prom"
cat >"$WORK/img-prom/Containerfile" <<'EOF'
FROM localhost/debian-base:bookworm
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /prometheus && chown nobody:nogroup /prometheus
USER nobody
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus", "--web.listen-address=:9090"]
EOF
timeout 600 podman build -q -t localhost/prometheus:debian "$WORK/img-prom" >/dev/null
podman tag localhost/prometheus:debian docker.io/prom/prometheus:latest

podman images
step "done"
