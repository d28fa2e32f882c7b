#!/usr/bin/env bash
# Runs a command that looks for NVIDIA's driver at fixed paths against a simulated node's driver
# root (tessera-sim install --driver-root DIR): in a private mount namespace (unshare -m), the
# root's libraries, nvidia-smi, device nodes and proc tree are laid over /usr/lib/x86_64-linux-gnu,
# /usr/bin, /dev and /proc/driver; nothing changes outside the command.
#
#   scripts/sim-driver-root-run.sh DRIVER_ROOT -- COMMAND [ARGS...]
#   e.g. scripts/sim-driver-root-run.sh /tmp/sim-root -- nvidia-ctk cdi generate --output=/tmp/nvidia.yaml
#
# As root it uses unshare -m; otherwise unshare -rm (a user namespace, where the kernel allows
# overlay mounts in one). The command sees the node named by TESSERA_SIM_STATE, else the one the
# root was installed for.
set -euo pipefail

if [[ $# -lt 3 || $2 != "--" ]]; then
  echo "usage: $0 DRIVER_ROOT -- COMMAND [ARGS...]" >&2
  exit 2
fi
root=$(cd "$1" && pwd)
shift 2
for need in usr/lib/x86_64-linux-gnu/libcuda.so.1 usr/bin/nvidia-smi dev/nvidiactl proc/driver/nvidia/version; do
  [[ -e $root/$need ]] || { echo "$0: $root/$need is missing: make the root with tessera-sim install --driver-root $root" >&2; exit 2; }
done

if [[ ${_TESSERA_SIM_IN_NAMESPACE:-} != 1 ]]; then
  flags=(-m)
  [[ $(id -u) -ne 0 ]] && flags=(-r -m)
  exec env _TESSERA_SIM_IN_NAMESPACE=1 unshare "${flags[@]}" --propagation private "$0" "$root" -- "$@"
fi

# Inside the namespace: lay each part of the root over the real path (an overlay keeps what is
# there and adds the root's files on top).
overlay() {
  local over=$1 target=$2
  mount -t overlay tessera-sim -o "lowerdir=$over:$target" "$target"
}
overlay "$root/usr/lib/x86_64-linux-gnu" /usr/lib/x86_64-linux-gnu
overlay "$root/usr/bin" /usr/bin
# /dev keeps its own mounts (pts, shm, mqueue): lay the overlay, then bring them back.
submounts=$(awk '$2 ~ "^/dev/" {print $2}' /proc/self/mounts)
host_dev=$(mktemp -d /tmp/.tessera-sim-dev.XXXXXX)
mount --rbind /dev "$host_dev"
overlay "$root/dev" /dev
for m in $submounts; do
  [[ -d $m ]] && mount --rbind "$host_dev${m#/dev}" "$m" 2>/dev/null || true
done
umount -l "$host_dev"
rmdir "$host_dev"
mount --bind "$root/proc/driver" /proc/driver
exec "$@"
