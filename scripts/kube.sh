#!/usr/bin/env bash
# A real single-node Kubernetes cluster on loopback, for the end-to-end tests (docs/kubernetes.md,
# "A real cluster"): etcd, kube-apiserver, kube-scheduler, kube-controller-manager, the kubelet and
# containerd 2 (CDI on) over Debian's runc, built from their published Go modules and cached under
# target/kube/.
#
#   scripts/kube.sh [--version 1.37|1.34] build   build (or find cached) the binaries and images
#   scripts/kube.sh [--version 1.37|1.34] up      build, then start the cluster; waits for a Ready node
#   scripts/kube.sh down                          stop it and remove its state (the node is left clean)
#   scripts/kube.sh env                           KEY=VALUE lines for the running cluster
#   scripts/kube.sh logs                          the last lines of every component's log
#   scripts/kube.sh restart COMPONENT             stop and start one (kubelet, kube-apiserver, ...)
#   scripts/kube.sh import-image IMAGE            copy a podman image (scripts/build-image.sh) into containerd
#
# Needs root, cgroups, Go (with the module proxy), openssl, gcc (the pause image), Debian's runc,
# busybox-static and containernetworking-plugins (scripts/deps.sh installs them).
#
# KUBE_FEATURE_GATES=Gate=false,... changes the feature gates `up` and `restart` give (each named
# gate replaces the default's entry): a cluster with a DRA feature off.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
kube=$root/target/kube
cluster=$kube/cluster
# The kubelet's and containerd's places on the host. The kubelet's device-plugin directory is
# fixed (/var/lib/kubelet/device-plugins); its root directory (pod-resources socket, DRA plugin
# directories, volumes) is its own, so that tesserads other tests start with the default
# pod-resources socket never meet this kubelet.
kubelet_root=/var/lib/tessera-kube/kubelet
device_plugin_dir=/var/lib/kubelet/device-plugins
run_dir=/run/tessera-kube
node_name=tessera-kube-node
# The node's address: the kubelet refuses a loopback one (127.0.0.0/8), so an address of its own on
# the loopback interface (reachable from this machine only), taken away at down.
node_ip=10.237.0.1
etcd_port=23790
etcd_peer_port=23800
api_port=6443
# The `kubernetes` Service's address (the first of --service-cluster-ip-range), which pods reach
# the API server through (KUBERNETES_SERVICE_HOST); the API server's certificate names it.
service_ip=10.96.0.1
# What the cluster is built from (the versions docs/kubernetes.md names).
etcd_version=v3.6.16
containerd_version=v2.2.9
pause_image=registry.k8s.io/pause:3.10.1
test_image=tessera.test/shell:1

version=1.37
cmd=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --version) version=${2:?--version needs 1.37 or 1.34}; shift 2 ;;
    --version=*) version=${1#--version=}; shift ;;
    up | down | env | build | logs) cmd=$1; shift ;;
    restart) cmd=restart; component=${2:?restart needs a component}; shift 2 ;;
    import-image) cmd=import-image; image=${2:?import-image needs an image (localhost/tessera:0.1.0)}; shift 2 ;;
    *) echo "kube.sh: unknown argument $1 (usage: scripts/kube.sh [--version 1.37|1.34] up|down|env|build|logs)" >&2; exit 2 ;;
  esac
done
case $version in
  1.37 | 1.37.2) k8s_version=v1.37.2 ;;
  1.34 | 1.34.4) k8s_version=v1.34.4 ;;
  *) echo "kube.sh: --version $version is not built here: 1.37 (v1.37.2) or 1.34 (v1.34.4)" >&2; exit 2 ;;
esac
k8s_bin=$kube/bin/kubernetes-$k8s_version
etcd_bin=$kube/bin/etcd-$etcd_version
containerd_bin=$kube/bin/containerd-$containerd_version
images=$kube/images
# The components' logs, kept after down (a failed run's diagnostics); emptied at up.
logs=$kube/logs

log() { echo "kube.sh: $*" >&2; }
die() { log "$*"; exit 1; }

# ---------------------------------------------------------------------------------------------
# Building

# The Go environment of every build: the module proxy only (no checksum database here: the
# module proxy's own hashes are recorded in each module's go.sum as the build goes), no
# toolchain download, static binaries.
go_env() {
  export GOWORK=off GOTOOLCHAIN=local GOSUMDB=off GOFLAGS="-mod=mod -buildvcs=false" CGO_ENABLED=0
}

# A writable copy of module $1 at version $2 under target/kube/src; prints its path.
module_copy() {
  local mod=$1 v=$2 dir dst
  dst=$kube/src/$(echo "$mod" | tr / _)@$v
  if [[ ! -e $dst/.copied ]]; then
    dir=$(go mod download -json "$mod@$v" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
    [[ -n $dir && -d $dir ]] || die "go mod download $mod@$v failed (is the Go module proxy reachable?)"
    rm -rf "$dst"
    mkdir -p "$(dirname "$dst")"
    cp -r "$dir" "$dst"
    chmod -R u+w "$dst"
    touch "$dst/.copied"
  fi
  echo "$dst"
}

build_kubernetes() {
  local want=(kube-apiserver kube-scheduler kube-controller-manager kubelet kubectl) b missing=0
  for b in "${want[@]}"; do [[ -x $k8s_bin/$b ]] || missing=1; done
  ((missing)) || return 0
  log "building Kubernetes $k8s_version (kube-apiserver, kube-scheduler, kube-controller-manager, kubelet, kubectl; about 25 minutes on 2 cores)"
  local src stage m
  src=$(module_copy k8s.io/kubernetes "$k8s_version")
  # The module's go.mod points its k8s.io/* libraries at ./staging, which the published module
  # leaves out: take the published library of the same release instead (v0.X.Y for v1.X.Y).
  stage=v0.${k8s_version#v1.}
  for m in $(sed -n 's#^[[:space:]]*\(k8s.io/[a-z0-9-]*\) => ./staging/.*#\1#p' "$src/go.mod"); do
    (cd "$src" && go mod edit -replace "$m=$m@$stage")
  done
  # The version the binaries report (kubectl version, the Node's kubeletVersion, /version), as
  # Kubernetes' own build stamps it.
  local minor=${k8s_version#v1.} pkg ldflags="-s -w"
  minor=${minor%%.*}
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $pkg.gitVersion=$k8s_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
  done
  mkdir -p "$k8s_bin.tmp"
  (cd "$src" && go build -trimpath -ldflags="$ldflags" -o "$k8s_bin.tmp/" $(printf './cmd/%s ' "${want[@]}"))
  rm -rf "$k8s_bin"
  mv "$k8s_bin.tmp" "$k8s_bin"
}

build_etcd() {
  [[ -x $etcd_bin/etcd ]] && return 0
  log "building etcd $etcd_version"
  local src m
  src=$(module_copy go.etcd.io/etcd/server/v3 "$etcd_version")
  # The server's go.mod points etcd's own modules at ../: take their published release.
  for m in $(sed -n 's#^[[:space:]]*\(go.etcd.io/etcd/[a-z0-9/]*\) => \.\./.*#\1#p' "$src/go.mod"); do
    (cd "$src" && go mod edit -replace "$m=$m@$etcd_version")
  done
  mkdir -p "$etcd_bin.tmp"
  (cd "$src" && go build -trimpath -ldflags="-s -w" -o "$etcd_bin.tmp/etcd" .)
  rm -rf "$etcd_bin"
  mv "$etcd_bin.tmp" "$etcd_bin"
}

build_containerd() {
  [[ -x $containerd_bin/containerd && -x $containerd_bin/containerd-shim-runc-v2 && -x $containerd_bin/ctr ]] && return 0
  log "building containerd $containerd_version (containerd, containerd-shim-runc-v2, ctr)"
  local src
  src=$(module_copy github.com/containerd/containerd/v2 "$containerd_version")
  mkdir -p "$containerd_bin.tmp"
  (cd "$src" && go build -trimpath -tags "no_btrfs no_devmapper no_zfs" -ldflags="-s -w" -o "$containerd_bin.tmp/" \
    ./cmd/containerd ./cmd/containerd-shim-runc-v2 ./cmd/ctr)
  rm -rf "$containerd_bin"
  mv "$containerd_bin.tmp" "$containerd_bin"
}

# An image archive (docker save layout, which ctr imports) of one layer: the directory $2,
# tagged $1, running $3... .
image_archive() {
  local tag=$1 rootfs=$2 out=$3
  shift 3
  local work diff entry
  work=$(mktemp -d)
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$rootfs" -cf "$work/layer.tar" .
  diff=$(sha256sum "$work/layer.tar" | cut -d' ' -f1)
  entry=$(printf '"%s",' "$@")
  printf '{"architecture":"amd64","os":"linux","config":{"Entrypoint":[%s],"Env":["PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"]},"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' \
    "${entry%,}" "$diff" >"$work/config.json"
  printf '[{"Config":"config.json","RepoTags":["%s"],"Layers":["layer.tar"]}]' "$tag" >"$work/manifest.json"
  tar -C "$work" -cf "$out.tmp" manifest.json config.json layer.tar
  mv "$out.tmp" "$out"
  rm -rf "$work"
}

build_images() {
  mkdir -p "$images"
  if [[ ! -s $images/pause.tar ]]; then
    log "building the pause image ($pause_image) from Kubernetes' build/pause/linux/pause.c"
    local src r
    src=$(module_copy k8s.io/kubernetes "$k8s_version")
    r=$(mktemp -d)
    gcc -Os -static -o "$r/pause" "$src/build/pause/linux/pause.c" -DVERSION=tessera-kube
    strip "$r/pause" || true
    image_archive "$pause_image" "$r" "$images/pause.tar" /pause
    rm -rf "$r"
  fi
  if [[ ! -s $images/shell.tar ]]; then
    log "building the test image ($test_image): busybox and the C runtime"
    local busybox r lib
    busybox=$(command -v busybox || true)
    [[ -n $busybox ]] || die "busybox is missing (Debian package busybox-static; scripts/deps.sh installs it)"
    r=$(mktemp -d)
    mkdir -p "$r/bin" "$r/lib/x86_64-linux-gnu" "$r/lib64" "$r/tmp" "$r/etc" "$r/usr/local/bin" "$r/proc" "$r/sys" "$r/dev" "$r/run"
    cp "$busybox" "$r/bin/busybox"
    for applet in $("$busybox" --list); do
      [[ $applet == busybox ]] || ln -sf busybox "$r/bin/$applet"
    done
    # What the workspace's programs and the (simulated) driver link against.
    for lib in libc.so.6 libm.so.6 libgcc_s.so.1 libdl.so.2 libpthread.so.0 librt.so.1; do
      [[ -e /lib/x86_64-linux-gnu/$lib ]] && cp -L "/lib/x86_64-linux-gnu/$lib" "$r/lib/x86_64-linux-gnu/"
    done
    cp -L /lib64/ld-linux-x86-64.so.2 "$r/lib64/"
    mkdir -p "$r/usr/lib"
    ln -s ../../lib/x86_64-linux-gnu "$r/usr/lib/x86_64-linux-gnu"
    echo "root:x:0:0:root:/:/bin/sh" >"$r/etc/passwd"
    image_archive "$test_image" "$r" "$images/shell.tar" /bin/sh
    rm -rf "$r"
  fi
}

build_all() {
  command -v go >/dev/null || die "go is missing: the cluster is built from Go modules (Go 1.26)"
  go_env
  build_etcd
  build_containerd
  build_kubernetes
  build_images
}

# ---------------------------------------------------------------------------------------------
# Certificates and configuration

# A key and a certificate signed by the cluster's CA: name, subject, extensions.
cert() {
  local name=$1 subj=$2 ext=$3 pki=$cluster/pki
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "$pki/$name.key" \
    -subj "$subj" -out "$pki/$name.csr" 2>/dev/null
  openssl x509 -req -in "$pki/$name.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
    -days 3650 -out "$pki/$name.crt" -extfile <(printf '%s\n' "$ext") 2>/dev/null
  rm -f "$pki/$name.csr"
}

kubeconfig() {
  local name=$1
  cat >"$cluster/$name.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: tessera-kube
  cluster:
    server: https://127.0.0.1:$api_port
    certificate-authority: $cluster/pki/ca.crt
users:
- name: $name
  user:
    client-certificate: $cluster/pki/$name.crt
    client-key: $cluster/pki/$name.key
contexts:
- name: tessera-kube
  context: {cluster: tessera-kube, user: $name}
current-context: tessera-kube
EOF
}

make_pki() {
  local pki=$cluster/pki
  [[ -s $pki/done ]] && return 0
  mkdir -p "$pki"
  chmod 700 "$pki"
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "$pki/ca.key" \
    -out "$pki/ca.crt" -days 3650 -subj "/CN=tessera-kube-ca" 2>/dev/null
  local client="extendedKeyUsage=clientAuth"
  cert apiserver "/CN=kube-apiserver" "subjectAltName=IP:127.0.0.1,IP:$service_ip,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local
extendedKeyUsage=serverAuth"
  cert apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" "$client"
  cert admin "/O=system:masters/CN=tessera-kube-admin" "$client"
  cert scheduler "/CN=system:kube-scheduler" "$client"
  cert controller-manager "/CN=system:kube-controller-manager" "$client"
  cert kubelet "/O=system:nodes/CN=system:node:$node_name" "$client"
  cert kubelet-serving "/O=system:nodes/CN=system:node:$node_name" "subjectAltName=IP:$node_ip,IP:127.0.0.1,DNS:$node_name,DNS:localhost
extendedKeyUsage=serverAuth"
  openssl genrsa -out "$pki/sa.key" 2048 2>/dev/null
  openssl rsa -in "$pki/sa.key" -pubout -out "$pki/sa.pub" 2>/dev/null
  for n in admin scheduler controller-manager kubelet; do kubeconfig "$n"; done
  echo done >"$pki/done"
}

# The feature gates each DRA feature needs, named as a user sets them (docs/kubernetes.md), with
# KUBE_FEATURE_GATES's entries in place of the same gates'.
feature_gates() {
  local gates over=${KUBE_FEATURE_GATES:-} kv out="" g
  gates=$(default_feature_gates)
  for kv in ${over//,/ }; do
    [[ $kv == *=* ]] || die "KUBE_FEATURE_GATES: $kv is not Gate=true|false"
  done
  for kv in ${gates//,/ }; do
    g=${kv%%=*}
    [[ ,$over, == *,$g=* ]] || out+="$kv,"
  done
  out+=$over
  echo "${out%,}"
}

default_feature_gates() {
  case $k8s_version in
    # 1.34: consumable capacity, partitionable devices, device taints and the health in pod
    # status are alpha (off by default); the claim's device status is beta (on).
    v1.34.*) echo "DRAConsumableCapacity=true,DRAPartitionableDevices=true,DRADeviceTaints=true,ResourceHealthStatus=true,DRAResourceClaimDeviceStatus=true" ;;
    # 1.37: all beta or GA and on by default; named so that the cluster says what it runs.
    *) echo "DRAConsumableCapacity=true,DRAPartitionableDevices=true,DRADeviceTaints=true,ResourceHealthStatus=true" ;;
  esac
}

runtime_config() {
  case $k8s_version in
    v1.34.*) echo "resource.k8s.io/v1beta1=true,resource.k8s.io/v1beta2=true,resource.k8s.io/v1alpha3=true" ;;
    *) echo "resource.k8s.io/v1beta2=true" ;;
  esac
}

write_configs() {
  mkdir -p "$cluster/cni" "$logs" "$run_dir/cdi"
  cat >"$cluster/containerd.toml" <<EOF
version = 3
root = "$cluster/containerd"
state = "$run_dir/containerd"

[grpc]
  address = "$run_dir/containerd.sock"

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "$pause_image"

[plugins.'io.containerd.cri.v1.runtime']
  # Root here may lack CAP_SYS_RESOURCE (a VM's sandbox): no container asks for an OOM score
  # below containerd's own (the kubelet gives pod sandboxes -998).
  restrict_oom_score_adj = true
  enable_cdi = true
  cdi_spec_dirs = ["$run_dir/cdi"]
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "$(command -v runc)"
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = "$cluster/cni"
EOF
  # Pods route through the bridge (isDefaultGateway): the kubernetes Service's address is not on
  # their subnet (service_route).
  cat >"$cluster/cni/10-tessera-kube.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "tessera-kube",
  "plugins": [
    {"type": "bridge", "bridge": "tkube0", "isGateway": true, "isDefaultGateway": true, "ipMasq": false,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.244.0.0/24"}]], "dataDir": "$run_dir/cni-ipam"}},
    {"type": "loopback"}
  ]
}
EOF
  local gates yaml_gates
  gates=$(feature_gates)
  yaml_gates=$(echo "$gates" | tr ',' '\n' | sed 's/^\(.*\)=\(.*\)$/  \1: \2/')
  cat >"$cluster/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $node_ip
healthzBindAddress: 127.0.0.1
readOnlyPort: 0
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $cluster/pki/ca.crt}
authorization: {mode: Webhook}
tlsCertFile: $cluster/pki/kubelet-serving.crt
tlsPrivateKeyFile: $cluster/pki/kubelet-serving.key
cgroupDriver: cgroupfs
# This machine's kernel mounts cgroup v1 controllers: the kubelet refuses them unless told.
failCgroupV1: false
failSwapOn: false
containerRuntimeEndpoint: unix://$run_dir/containerd.sock
clusterDomain: cluster.local
resolvConf: /etc/resolv.conf
# A test node with a mostly full disk must still run pods.
evictionHard: {memory.available: "50Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
# Status reaches the API server quickly (the tests poll it).
nodeStatusUpdateFrequency: 4s
syncFrequency: 10s
serializeImagePulls: false
featureGates:
$yaml_gates
EOF
}

# ---------------------------------------------------------------------------------------------
# Running

pid_alive() { [[ -s $cluster/$1.pid ]] && kill -0 "$(cat "$cluster/$1.pid")" 2>/dev/null; }

# Starts component $1 (its log in logs/$1.log, its pid in $1.pid): the command after it.
start() {
  local name=$1
  shift
  if pid_alive "$name"; then return 0; fi
  setsid "$@" >>"$logs/$name.log" 2>&1 </dev/null &
  echo $! >"$cluster/$name.pid"
}

stop() {
  local name=$1 pid i
  [[ -s $cluster/$name.pid ]] || return 0
  pid=$(cat "$cluster/$name.pid")
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null || true
    for i in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$cluster/$name.pid"
}

# Waits up to $2 seconds for command $3... to succeed; names $1 and shows its log when it does not.
wait_for() {
  local what=$1 secs=$2 deadline
  shift 2
  deadline=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS >= deadline)); then
      log "$what did not come up within ${secs}s"
      show_logs
      return 1
    fi
    sleep 1
  done
}

show_logs() {
  local f
  for f in "$logs"/*.log; do
    [[ -e $f ]] || continue
    echo "----- $(basename "$f") (last 40 lines)" >&2
    tail -n 40 "$f" >&2
  done
}

kubectl_() { "$k8s_bin/kubectl" --kubeconfig "$cluster/admin.kubeconfig" "$@"; }

check_host() {
  [[ $(id -u) -eq 0 ]] || die "the kubelet and containerd need root"
  [[ -d /sys/fs/cgroup ]] || die "no /sys/fs/cgroup: the kubelet needs cgroups"
  command -v runc >/dev/null || die "runc is missing (Debian package runc; scripts/deps.sh installs it)"
  [[ -x /usr/lib/cni/bridge ]] || die "the CNI plugins are missing (Debian package containernetworking-plugins; scripts/deps.sh installs it)"
  command -v openssl >/dev/null || die "openssl is missing"
}

up() {
  check_host
  build_all
  if [[ -s $cluster/version && $(cat "$cluster/version") != "$k8s_version" ]]; then
    log "a $(cat "$cluster/version") cluster is up: taking it down first"
    down
  fi
  mkdir -p "$cluster" "$logs"
  rm -f "$logs"/*.log
  echo "$k8s_version" >"$cluster/version"
  make_pki
  write_configs
  local gates
  gates=$(feature_gates)

  start etcd "$etcd_bin/etcd" --name tessera-kube --data-dir "$cluster/etcd" \
    --listen-client-urls "http://127.0.0.1:$etcd_port" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
    --listen-peer-urls "http://127.0.0.1:$etcd_peer_port" --initial-advertise-peer-urls "http://127.0.0.1:$etcd_peer_port" \
    --initial-cluster "tessera-kube=http://127.0.0.1:$etcd_peer_port" --unsafe-no-fsync --log-level warn
  start_apiserver
  wait_for kube-apiserver 180 kubectl_ get --raw /readyz
  start kube-controller-manager "$k8s_bin/kube-controller-manager" --kubeconfig "$cluster/controller-manager.kubeconfig" \
    --bind-address 127.0.0.1 --leader-elect=false --use-service-account-credentials \
    --service-account-private-key-file "$cluster/pki/sa.key" --root-ca-file "$cluster/pki/ca.crt" \
    --cluster-signing-cert-file "$cluster/pki/ca.crt" --cluster-signing-key-file "$cluster/pki/ca.key" \
    --feature-gates "$gates"
  start kube-scheduler "$k8s_bin/kube-scheduler" --kubeconfig "$cluster/scheduler.kubeconfig" \
    --bind-address 127.0.0.1 --leader-elect=false --feature-gates "$gates"
  # Each running and answering (a port another process holds makes one exit at once).
  wait_for kube-controller-manager 120 healthy kube-controller-manager 10257
  wait_for kube-scheduler 120 healthy kube-scheduler 10259
  start_containerd
  wait_for containerd 60 "$containerd_bin/ctr" --address "$run_dir/containerd.sock" version
  import_images
  service_route
  start_kubelet
  wait_for "the node $node_name (Ready)" 240 node_ready
  # Pods need a service account in their namespace before they can be created.
  wait_for "the default service account" 120 kubectl_ get serviceaccount default -n default
  log "the cluster is up ($k8s_version, node $node_name); scripts/kube.sh env prints its settings"
}

start_apiserver() {
  start kube-apiserver "$k8s_bin/kube-apiserver" --etcd-servers "http://127.0.0.1:$etcd_port" \
    --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$api_port" \
    --service-cluster-ip-range ${service_ip%.*}.0/24 --client-ca-file "$cluster/pki/ca.crt" \
    --tls-cert-file "$cluster/pki/apiserver.crt" --tls-private-key-file "$cluster/pki/apiserver.key" \
    --kubelet-client-certificate "$cluster/pki/apiserver-kubelet-client.crt" --kubelet-client-key "$cluster/pki/apiserver-kubelet-client.key" \
    --service-account-issuer https://kubernetes.default.svc.cluster.local --service-account-key-file "$cluster/pki/sa.pub" \
    --service-account-signing-key-file "$cluster/pki/sa.key" --authorization-mode Node,RBAC \
    --enable-admission-plugins NodeRestriction --allow-privileged=true --endpoint-reconciler-type none \
    --kubelet-preferred-address-types InternalIP \
    --feature-gates "$(feature_gates)" --runtime-config "$(runtime_config)"
}

start_containerd() {
  mkdir -p "$run_dir"
  # Its own shim first on the PATH (Debian's containerd 1.x installs another).
  start containerd env PATH="$containerd_bin:$PATH" "$containerd_bin/containerd" --config "$cluster/containerd.toml"
}

# The DaemonSet mounts /run/tessera with Bidirectional propagation (the allocations' regions reach
# the host): containerd needs a shared mount there. systemd makes / shared; this machine's is
# private, so /run/tessera is bound onto itself, shared, until down.
shared_run_tessera() {
  mkdir -p /run/tessera
  if ! mountpoint -q /run/tessera; then
    mount --bind /run/tessera /run/tessera && mount --make-shared /run/tessera && touch "$cluster/run-tessera-bound"
  fi
}

# What kube-proxy gives a real cluster for the `kubernetes` Service, and no more: $service_ip:443
# goes to the API server on 127.0.0.1:$api_port, from pods (PREROUTING; loopback as a destination
# needs route_localnet on the pods' bridge) and from the host and host-network pods (OUTPUT).
# Every rule carries the comment tessera-kube, and down removes exactly those.
service_rules() {
  local op=$1 chain
  for chain in PREROUTING OUTPUT; do
    if [[ $op == -A ]] && iptables -t nat -C "$chain" -d "$service_ip/32" -p tcp --dport 443 \
      -m comment --comment tessera-kube -j DNAT --to-destination "127.0.0.1:$api_port" 2>/dev/null; then
      continue
    fi
    iptables -t nat "$op" "$chain" -d "$service_ip/32" -p tcp --dport 443 \
      -m comment --comment tessera-kube -j DNAT --to-destination "127.0.0.1:$api_port" 2>/dev/null || [[ $op == -D ]]
  done
}

service_route() {
  command -v iptables >/dev/null || die "iptables is missing (Debian package iptables): pods reach the API server through the kubernetes Service"
  service_rules -A || die "iptables could not add the kubernetes Service's DNAT ($service_ip:443 to 127.0.0.1:$api_port)"
  # The pods' bridge exists once the first pod runs: allow loopback destinations on every
  # interface for now (the old value is kept and put back at down).
  if [[ ! -e $cluster/route_localnet ]]; then
    sysctl -n net.ipv4.conf.all.route_localnet >"$cluster/route_localnet"
  fi
  sysctl -qw net.ipv4.conf.all.route_localnet=1
}

start_kubelet() {
  mkdir -p "$kubelet_root"
  shared_run_tessera
  ip -4 -o addr show dev lo | grep -q " $node_ip/" || ip addr add "$node_ip/32" dev lo
  start kubelet "$k8s_bin/kubelet" --config "$cluster/kubelet.yaml" --kubeconfig "$cluster/kubelet.kubeconfig" \
    --hostname-override "$node_name" --node-ip "$node_ip" --root-dir "$kubelet_root" --v 2
}

# Component $1 runs (its pid alive) and answers /healthz on 127.0.0.1:$2.
healthy() {
  pid_alive "$1" && curl -ksf "https://127.0.0.1:$2/healthz" >/dev/null
}

node_ready() {
  [[ $(kubectl_ get node "$node_name" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null) == True ]]
}

import_images() {
  local t
  local out
  for t in pause shell; do
    out=$("$containerd_bin/ctr" --address "$run_dir/containerd.sock" -n k8s.io images import --platform linux/amd64 \
      "$images/$t.tar" 2>&1) || die "importing $images/$t.tar into containerd failed: $out"
  done
}

down() {
  if [[ -d $kubelet_root ]] || [[ -d $cluster ]]; then
    # Pods first, while the kubelet still runs, so their containers and mounts go with them.
    if pid_alive kubelet && pid_alive kube-apiserver; then
      kubectl_ delete pods --all --all-namespaces --grace-period=0 --force --wait=false >/dev/null 2>&1 || true
    fi
  fi
  stop kubelet
  stop kube-scheduler
  stop kube-controller-manager
  # What containerd still runs: every task in its namespace killed, then containerd.
  if pid_alive containerd; then
    local ctr=("$containerd_bin/ctr" --address "$run_dir/containerd.sock" -n k8s.io) t
    for t in $("${ctr[@]}" tasks ls -q 2>/dev/null); do
      "${ctr[@]}" tasks kill -s SIGKILL "$t" >/dev/null 2>&1 || true
    done
    sleep 1
    for t in $("${ctr[@]}" tasks ls -q 2>/dev/null); do "${ctr[@]}" tasks delete -f "$t" >/dev/null 2>&1 || true; done
    for t in $("${ctr[@]}" containers ls -q 2>/dev/null); do "${ctr[@]}" containers delete "$t" >/dev/null 2>&1 || true; done
  fi
  stop containerd
  # Shims that outlived containerd.
  local p
  for p in $(pgrep -f "^$containerd_bin/containerd-shim-runc-v2" 2>/dev/null || true); do kill -9 "$p" 2>/dev/null || true; done
  stop kube-apiserver
  stop etcd
  # Mounts the kubelet and containerd left (volumes, rootfs, network namespaces), deepest first.
  local m
  for m in $(awk '{print $2}' /proc/self/mounts | grep -E "^($kubelet_root|$run_dir|$cluster|$device_plugin_dir)(/|$)" | sort -r); do
    umount -l "$m" 2>/dev/null || true
  done
  if [[ -e $cluster/run-tessera-bound ]]; then umount -l /run/tessera 2>/dev/null || true; fi
  ip link del tkube0 2>/dev/null || true
  if command -v iptables >/dev/null; then service_rules -D; fi
  if [[ -s $cluster/route_localnet ]]; then sysctl -qw "net.ipv4.conf.all.route_localnet=$(cat "$cluster/route_localnet")" || true; fi
  ip addr del "$node_ip/32" dev lo 2>/dev/null || true
  rm -rf "$kubelet_root" "$run_dir" "$cluster" "$device_plugin_dir"
  rmdir /var/lib/kubelet /var/lib/tessera-kube 2>/dev/null || true
  # The pods' cgroups (cgroupfs driver: kubepods under each controller).
  local c
  for c in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/kubepods /sys/fs/cgroup/unified/kubepods; do
    [[ -d $c ]] && find "$c" -depth -type d -exec rmdir {} \; 2>/dev/null || true
  done
  log "the cluster is down"
}

env_lines() {
  [[ -s $cluster/version ]] || die "no cluster is up (scripts/kube.sh up)"
  local v
  v=$(cat "$cluster/version")
  echo "KUBECONFIG=$cluster/admin.kubeconfig"
  echo "KUBECTL=$kube/bin/kubernetes-$v/kubectl"
  echo "KUBE_VERSION=$v"
  echo "KUBE_NODE_NAME=$node_name"
  echo "KUBELET_ROOT_DIR=$kubelet_root"
  echo "KUBELET_DEVICE_PLUGIN_DIR=$device_plugin_dir"
  echo "KUBELET_POD_RESOURCES_SOCKET=$kubelet_root/pod-resources/kubelet.sock"
  echo "KUBELET_PLUGINS_DIR=$kubelet_root/plugins"
  echo "KUBELET_PLUGINS_REGISTRY_DIR=$kubelet_root/plugins_registry"
  echo "KUBE_CDI_SPEC_DIR=$run_dir/cdi"
  echo "KUBE_LOG_DIR=$logs"
  echo "TEST_IMAGE=$test_image"
}

case $cmd in
  build) check_host; build_all ;;
  up) up ;;
  down) down ;;
  env) env_lines ;;
  logs) show_logs ;;
  import-image)
    # What a node pulling the image would get, from podman's store (scripts/build-image.sh).
    command -v podman >/dev/null || die "podman is missing (scripts/build-image.sh builds with it)"
    archive=$(mktemp)
    podman save --format docker-archive -o "$archive" "$image" >/dev/null 2>&1 || die "podman save $image failed"
    out=$("$containerd_bin/ctr" --address "$run_dir/containerd.sock" -n k8s.io images import --platform linux/amd64 \
      "$archive" 2>&1) || { rm -f "$archive"; die "importing $image into containerd failed: $out"; }
    rm -f "$archive" ;;
  restart)
    k8s_version=$(cat "$cluster/version")
    k8s_bin=$kube/bin/kubernetes-$k8s_version
    stop "$component"
    case $component in
      kubelet) start_kubelet ;;
      kube-apiserver) start_apiserver; wait_for kube-apiserver 180 kubectl_ get --raw /readyz ;;
      *) die "restart: $component is not one kube.sh restarts (kubelet, kube-apiserver)" ;;
    esac ;;
  *) echo "usage: scripts/kube.sh [--version 1.37|1.34] up|down|env|build|logs" >&2; exit 2 ;;
esac
