#!/usr/bin/env bash
# Link lab: honest network-bound measurements on one machine.
#
#   linklab.sh --ranks W [--gbit G] [--delay-ms D] [--keep] -- COMMAND [ARGS...]
#
# Creates W+1 network namespaces of its own: one per rank (ciera<id>-r<k>, address
# 10.231.0.<k+1>/24) and a hub (ciera<id>-hub, 10.231.0.254) holding a Linux bridge; every rank
# joins the bridge through a veth pair. With --gbit, both directions of every rank's link are
# shaped with `tc tbf` to G Gbit/s (a full-duplex NIC of that speed); --delay-ms adds netem delay.
# COMMAND then runs under Open MPI over TCP only, one rank per namespace: mpirun starts the ranks
# from the hub and linklab-agent.sh moves each into its namespace before COMMAND starts; the
# ranks reach mpirun's PMIx server at the hub's bridge address.
#
# Only addresses inside these namespaces are used, and everything is removed on exit, including
# on failure or Ctrl-C. Needs root (CAP_NET_ADMIN), iproute2 and Open MPI.
set -euo pipefail

ranks=""
gbit=0
delay_ms=0
keep=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --ranks) ranks=$2; shift 2 ;;
    --gbit) gbit=$2; shift 2 ;;
    --delay-ms) delay_ms=$2; shift 2 ;;
    --keep) keep=1; shift ;;
    --) shift; break ;;
    *) echo "linklab: unknown option $1" >&2; exit 2 ;;
  esac
done
# Numbers may arrive as "1.000"; zero means "off".
is_zero() { awk -v x="$1" 'BEGIN { exit !(x + 0 == 0) }'; }
if [[ -z "$ranks" || $# -eq 0 ]]; then
  echo "usage: linklab.sh --ranks W [--gbit G] [--delay-ms D] -- COMMAND [ARGS...]" >&2
  exit 2
fi
if [[ $(id -u) -ne 0 ]] || ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
  echo "linklab: needs root, iproute2 (ip, tc) to create network namespaces" >&2
  exit 77
fi
if ! ip netns add "ciera-probe-$$" 2>/dev/null; then
  echo "linklab: network namespaces are not permitted here" >&2
  exit 77
fi
ip netns delete "ciera-probe-$$"

here=$(cd "$(dirname "$0")" && pwd)
id="$$"
hub="ciera${id}-hub"
subnet="10.231.0"
namespaces=()

teardown() {
  local status=$?
  if [[ $keep -eq 0 ]]; then
    for ns in "${namespaces[@]}"; do ip netns delete "$ns" 2>/dev/null || true; done
  fi
  exit "$status"
}
trap teardown EXIT
trap 'exit 130' INT TERM

# tbf needs a bucket that covers a few milliseconds at the rate (and at least a 64 KiB GSO packet).
shape() {  # namespace device
  local ns=$1 dev=$2
  is_zero "$gbit" && return 0
  local bytes_per_s burst
  bytes_per_s=$(awk -v g="$gbit" 'BEGIN { printf "%d", g * 1e9 / 8 }')
  burst=$(awk -v b="$bytes_per_s" 'BEGIN { x = b / 400; if (x < 131072) x = 131072; printf "%d", x }')
  if ! is_zero "$delay_ms"; then
    ip netns exec "$ns" tc qdisc add dev "$dev" root handle 1: netem delay "${delay_ms}ms" ||
      { echo "linklab: netem is unavailable (kernel module sch_netem); run without --delay-ms" >&2; return 1; }
    ip netns exec "$ns" tc qdisc add dev "$dev" parent 1:1 handle 10: tbf rate "${gbit}gbit" burst "$burst" latency 50ms
  else
    ip netns exec "$ns" tc qdisc add dev "$dev" root tbf rate "${gbit}gbit" burst "$burst" latency 50ms
  fi
}

ip netns add "$hub"
namespaces+=("$hub")
ip netns exec "$hub" ip link set lo up
ip netns exec "$hub" ip link add br0 type bridge
ip netns exec "$hub" ip link set br0 up
ip netns exec "$hub" ip addr add "${subnet}.254/24" dev br0

for ((r = 0; r < ranks; r++)); do
  ns="ciera${id}-r${r}"
  ip netns add "$ns"
  namespaces+=("$ns")
  ip netns exec "$ns" ip link set lo up
  ip link add "cl${id}r${r}" netns "$ns" type veth peer name "ch${id}r${r}" netns "$hub"
  ip netns exec "$ns" ip link set "cl${id}r${r}" name eth0
  ip netns exec "$ns" ip addr add "${subnet}.$((r + 1))/24" dev eth0
  ip netns exec "$ns" ip link set eth0 up
  ip netns exec "$hub" ip link set "ch${id}r${r}" master br0
  ip netns exec "$hub" ip link set "ch${id}r${r}" up
  shape "$ns" eth0                  # rank -> network
  shape "$hub" "ch${id}r${r}"       # network -> rank
done

echo "linklab: ${ranks} ranks, $(is_zero "$gbit" && echo unshaped || echo "${gbit} Gbit/s per link")$(is_zero "$delay_ms" || echo ", ${delay_ms} ms delay")" >&2

export CIERA_LINKLAB_PREFIX="ciera${id}"
ip netns exec "$hub" env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
  CIERA_LINKLAB_GBIT="$gbit" CIERA_LINKLAB_DELAY_MS="$delay_ms" \
  PMIX_MCA_ptl_tcp_if_include="${subnet}.0/24" \
  mpirun --allow-run-as-root --oversubscribe -np "$ranks" \
  --mca btl tcp,self --mca btl_tcp_if_include "${subnet}.0/24" \
  --mca mpi_yield_when_idle 1 \
  -x CIERA_LINKLAB_PREFIX -x CIERA_LINKLAB_GBIT -x CIERA_LINKLAB_DELAY_MS \
  "$here/linklab-agent.sh" "$@"
