#!/usr/bin/env bash
# Link lab: honest network-bound measurements on one machine.
#
#   linklab.sh --ranks W [--gbit G] [--delay-ms D] [--keep] -- COMMAND [ARGS...]
#   linklab.sh --nodes K --ranks-per-node R [--ranks K*R] [--gbit G] [--delay-ms D] [--keep] -- ...
#
# Flat (--ranks W, or R = 1): W+1 network namespaces of its own, one per rank (ciera<id>-r<k>,
# address 10.231.0.<k+1>/24) and a hub (ciera<id>-hub, 10.231.0.254) holding a Linux bridge;
# every rank joins the bridge through a veth pair, its own link: every rank is its own node.
# Two-level (--nodes K --ranks-per-node R, R > 1; W = K*R): each node also gets a namespace
# (ciera<id>-n<n>) holding a bridge; the node's R ranks (n*R .. n*R+R-1, in mpirun's rank order)
# join it through unshaped veth pairs, and the node bridge joins the hub through one veth pair,
# the node's uplink (its NIC), which all its ranks share. Ranks and hub keep the addresses above.
#
# With --gbit, both directions of every uplink (flat: every rank's link) are shaped with `tc tbf`
# to G Gbit/s (a full-duplex NIC of that speed), B_inter per node as in docs/simulator.md;
# --delay-ms adds netem delay there. COMMAND then runs under Open MPI over TCP only, one rank per
# namespace: mpirun starts the ranks from the hub and linklab-agent.sh moves each into its
# namespace before COMMAND starts; the ranks reach mpirun's PMIx server at the hub's address.
#
# The ranks see CIERA_LINKLAB_NODES=K and CIERA_LINKLAB_RANKS_PER_NODE=R (flat: W and 1), so a
# program can tell which ranks share a node, CIERA_LINKLAB_CC (below), and CIERA_LINKLAB_UPLINKS,
# the hub's end of each uplink in node order, with CIERA_LINKLAB_HUB_PID, a process in the hub's
# namespace: as root a rank can read the uplinks' counters while it runs from
# /proc/$CIERA_LINKLAB_HUB_PID/net/dev (what the hub's end receives is what that node sent).
#
# Inter-node bytes: when CIERA_LINKLAB_COUNTERS names a file, the lab writes there at exit
# (COMMAND's failure and Ctrl-C included, once COMMAND has started)
#   {"nodes": K, "ranks_per_node": R, "gbit": G,
#    "uplinks": [{"node": n, "tx_bytes": ..., "rx_bytes": ...}, ...]}
# from each uplink's node end (/sys/class/net/<dev>/statistics; tx: what the node sent to other
# nodes, rx: what it received, Ethernet frames whole, ACKs and launcher traffic included), counted
# from just before COMMAND started. A line on stderr sums them either way.
#
# TCP congestion control: every rank's connections use CUBIC (Linux's default), pinned on the
# rank's route (`ip route ... congctl`, which a namespace may set whatever the host allows it by
# sysctl), so that the lab's links behave the same on every host. CIERA_LINKLAB_CC=NAME picks
# another the kernel offers; CIERA_LINKLAB_CC=default keeps the host's. Why: on a host whose
# default is BBR, BBR over tbf-shaped links stopped every flow of a call for 40-60 ms in up to one
# call in four, the links idle and the cores idle (docs/benchmarks.md, "The link lab's TCP").
#
# Only addresses inside these namespaces are used, and everything is removed on exit, including
# on failure or Ctrl-C. Needs root (CAP_NET_ADMIN), iproute2 and Open MPI.
set -euo pipefail

usage="usage: linklab.sh (--ranks W | --nodes K --ranks-per-node R) [--gbit G] [--delay-ms D] [--keep] -- COMMAND [ARGS...]"
ranks=""
nodes=""
per_node=""
gbit=0
delay_ms=0
keep=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --ranks) ranks=$2; shift 2 ;;
    --nodes) nodes=$2; shift 2 ;;
    --ranks-per-node) per_node=$2; shift 2 ;;
    --gbit) gbit=$2; shift 2 ;;
    --delay-ms) delay_ms=$2; shift 2 ;;
    --keep) keep=1; shift ;;
    --) shift; break ;;
    *) echo "linklab: unknown option $1" >&2; exit 2 ;;
  esac
done
cc=${CIERA_LINKLAB_CC:-cubic}
if [[ "$cc" != default ]] && { [[ ! "$cc" =~ ^[a-z0-9_]+$ ]] ||
     ! grep -qw -- "$cc" /proc/sys/net/ipv4/tcp_available_congestion_control 2>/dev/null; }; then
  echo "linklab: the kernel offers no TCP congestion control '$cc' (it has:" \
       "$(cat /proc/sys/net/ipv4/tcp_available_congestion_control 2>/dev/null));" \
       "set CIERA_LINKLAB_CC to one of them, or to 'default' for the host's own" >&2
  exit 2
fi
# Numbers may arrive as "1.000"; zero means "off".
is_zero() { awk -v x="$1" 'BEGIN { exit !(x + 0 == 0) }'; }
is_count() { [[ $1 =~ ^[1-9][0-9]{0,5}$ ]]; }
fail() { echo "linklab: $1" >&2; exit 2; }
if [[ $# -eq 0 || (-z "$ranks" && -z "$nodes" && -z "$per_node") ]]; then
  echo "$usage" >&2
  exit 2
fi
if [[ -n "$nodes" || -n "$per_node" ]]; then
  [[ -n "$nodes" && -n "$per_node" ]] || fail "--nodes and --ranks-per-node go together"
  is_count "$nodes" || fail "--nodes must be a whole number >= 1, not '$nodes'"
  is_count "$per_node" || fail "--ranks-per-node must be a whole number >= 1, not '$per_node'"
  if [[ -n "$ranks" && "$ranks" != "$((nodes * per_node))" ]]; then
    fail "--ranks $ranks disagrees with --nodes $nodes --ranks-per-node $per_node ($((nodes * per_node)) ranks)"
  fi
  ranks=$((nodes * per_node))
else
  is_count "$ranks" || fail "--ranks must be a whole number >= 1, not '$ranks'"
  nodes=$ranks
  per_node=1
fi
# One /24: ranks .1 to .253, the hub .254.
((ranks <= 253)) || fail "$ranks ranks: the lab has room for at most 253 (one /24 beside its hub)"
awk -v x="$gbit" 'BEGIN { exit !(x ~ /^[0-9]*\.?[0-9]+$|^[0-9]+\.$/) }' ||
  fail "--gbit must be a number of Gbit/s >= 0, not '$gbit'"
awk -v x="$delay_ms" 'BEGIN { exit !(x ~ /^[0-9]*\.?[0-9]+$|^[0-9]+\.$/) }' ||
  fail "--delay-ms must be a number of milliseconds >= 0, not '$delay_ms'"
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
# Device names hold at most 15 characters: "ch" + a 7-digit PID + "r252" is 13.
id="$$"
hub="ciera${id}-hub"
subnet="10.231.0"
namespaces=()
uplink_ns=()       # per node: the namespace holding the node's end of its uplink
uplink_dev=()      # per node: that end's device
uplink_hub_dev=()  # per node: the hub's end
counting=0         # 1 once COMMAND has started: the counters below are its baseline
base_tx=()
base_rx=()

# Prints "<tx_bytes> <rx_bytes>" of node n's uplink, at its node end.
read_uplink() {
  local n=$1 out
  out=$(ip netns exec "${uplink_ns[n]}" cat "/sys/class/net/${uplink_dev[n]}/statistics/tx_bytes" \
    "/sys/class/net/${uplink_dev[n]}/statistics/rx_bytes") || return 1
  echo $out  # the two lines as one
}

# Writes $CIERA_LINKLAB_COUNTERS (when set) and the stderr summary: bytes since the baseline.
report_counters() {
  local n now tx rx total_tx=0 total_rx=0 entries="" detail=""
  for ((n = 0; n < nodes; n++)); do
    now=$(read_uplink "$n") || { echo "linklab: could not read node $n's uplink counters" >&2; return 1; }
    read -r tx rx <<<"$now"
    tx=$((tx - base_tx[n]))
    rx=$((rx - base_rx[n]))
    total_tx=$((total_tx + tx))
    total_rx=$((total_rx + rx))
    entries+="${entries:+, }{\"node\": $n, \"tx_bytes\": $tx, \"rx_bytes\": $rx}"
    ((nodes > 8)) || detail+="${detail:+, }node $n tx $tx rx $rx"
  done
  local file=${CIERA_LINKLAB_COUNTERS:-}
  if [[ -n "$file" ]]; then
    printf '{"nodes": %d, "ranks_per_node": %d, "gbit": %s, "uplinks": [%s]}\n' "$nodes" \
      "$per_node" "$(awk -v g="$gbit" 'BEGIN { printf "%.17g", g + 0 }')" "$entries" >"$file" ||
      echo "linklab: could not write CIERA_LINKLAB_COUNTERS=$file" >&2
  fi
  echo "linklab: inter-node bytes while the command ran: ${total_tx} sent, ${total_rx} received over ${nodes} node uplinks${detail:+ ($detail)}${file:+; per node in $file}" >&2
}

teardown() {
  local status=$?
  if [[ $counting -eq 1 ]]; then report_counters || true; fi
  if [[ $keep -eq 0 ]]; then
    for ns in "${namespaces[@]}"; do ip netns delete "$ns" 2>/dev/null || true; done
  fi
  exit "$status"
}
trap teardown EXIT
trap 'exit 130' INT TERM HUP

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

add_namespace() {  # name
  ip netns add "$1"
  namespaces+=("$1")
  ip netns exec "$1" ip link set lo up
}

add_bridge() {  # namespace
  ip netns exec "$1" ip link add br0 type bridge
  ip netns exec "$1" ip link set br0 up
}

# Rank r's namespace, its eth0 joined to the bridge in `switch_ns` through a veth pair whose
# other end is `switch_dev`.
add_rank() {  # rank switch_ns switch_dev
  local r=$1 switch_ns=$2 switch_dev=$3 ns="ciera${id}-r$1"
  add_namespace "$ns"
  ip link add "cl${id}r${r}" netns "$ns" type veth peer name "$switch_dev" netns "$switch_ns"
  ip netns exec "$ns" ip link set "cl${id}r${r}" name eth0
  ip netns exec "$ns" ip addr add "${subnet}.$((r + 1))/24" dev eth0
  ip netns exec "$ns" ip link set eth0 up
  if [[ "$cc" != default ]]; then
    ip netns exec "$ns" ip route replace "${subnet}.0/24" dev eth0 proto kernel scope link \
      src "${subnet}.$((r + 1))" congctl "$cc"
  fi
  ip netns exec "$switch_ns" ip link set "$switch_dev" master br0
  ip netns exec "$switch_ns" ip link set "$switch_dev" up
}

add_namespace "$hub"
add_bridge "$hub"
ip netns exec "$hub" ip addr add "${subnet}.254/24" dev br0

if ((per_node == 1)); then
  # Every rank is its own node: its link to the hub is its uplink.
  for ((r = 0; r < ranks; r++)); do
    add_rank "$r" "$hub" "ch${id}r${r}"
    uplink_ns+=("ciera${id}-r${r}")
    uplink_dev+=(eth0)
    uplink_hub_dev+=("ch${id}r${r}")
  done
else
  for ((n = 0; n < nodes; n++)); do
    node_ns="ciera${id}-n${n}"
    add_namespace "$node_ns"
    add_bridge "$node_ns"
    ip link add "cu${id}n${n}" netns "$node_ns" type veth peer name "ch${id}n${n}" netns "$hub"
    ip netns exec "$node_ns" ip link set "cu${id}n${n}" master br0
    ip netns exec "$node_ns" ip link set "cu${id}n${n}" up
    ip netns exec "$hub" ip link set "ch${id}n${n}" master br0
    ip netns exec "$hub" ip link set "ch${id}n${n}" up
    uplink_ns+=("$node_ns")
    uplink_dev+=("cu${id}n${n}")
    uplink_hub_dev+=("ch${id}n${n}")
    for ((j = 0; j < per_node; j++)); do
      add_rank "$((n * per_node + j))" "$node_ns" "cn${id}r$((n * per_node + j))"
    done
  done
fi
for ((n = 0; n < nodes; n++)); do
  shape "${uplink_ns[n]}" "${uplink_dev[n]}"  # node -> network
  shape "$hub" "${uplink_hub_dev[n]}"         # network -> node
done

speed=$(is_zero "$gbit" && echo unshaped || echo "${gbit} Gbit/s per $( ((per_node == 1)) && echo link || echo "node uplink")")
echo "linklab: ${ranks} ranks$( ((per_node == 1)) || echo " on ${nodes} nodes of ${per_node}"), ${speed}$(is_zero "$delay_ms" || echo ", ${delay_ms} ms delay"), TCP ${cc}" >&2

for ((n = 0; n < nodes; n++)); do
  now=$(read_uplink "$n")
  read -r "base_tx[n]" "base_rx[n]" <<<"$now"
done
counting=1
uplinks=$(IFS=,; echo "${uplink_hub_dev[*]}")
export CIERA_LINKLAB_PREFIX="ciera${id}"
# Set before mpirun starts, so that no signal finds it running and the old trap in place (which
# would remove the namespaces under it): once it runs, a signal goes on to it (below).
child=
trap 'if [[ -n $child ]]; then kill -TERM "$child" 2>/dev/null; kill -CONT "$child" 2>/dev/null; wait "$child" || true; fi; exit 130' INT TERM HUP
# `exec` keeps the PID: CIERA_LINKLAB_HUB_PID is mpirun's, a process in the hub's namespace.
ip netns exec "$hub" env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
  CIERA_LINKLAB_GBIT="$gbit" CIERA_LINKLAB_DELAY_MS="$delay_ms" \
  CIERA_LINKLAB_NODES="$nodes" CIERA_LINKLAB_RANKS_PER_NODE="$per_node" \
  CIERA_LINKLAB_UPLINKS="$uplinks" CIERA_LINKLAB_CC="$cc" \
  PMIX_MCA_ptl_tcp_if_include="${subnet}.0/24" \
  bash -c 'export CIERA_LINKLAB_HUB_PID=$$; exec "$@"' linklab-hub \
  mpirun --allow-run-as-root --oversubscribe -np "$ranks" \
  --mca btl tcp,self --mca btl_tcp_if_include "${subnet}.0/24" \
  --mca mpi_yield_when_idle 1 \
  -x CIERA_LINKLAB_PREFIX -x CIERA_LINKLAB_GBIT -x CIERA_LINKLAB_DELAY_MS \
  -x CIERA_LINKLAB_NODES -x CIERA_LINKLAB_RANKS_PER_NODE -x CIERA_LINKLAB_UPLINKS \
  -x CIERA_LINKLAB_HUB_PID -x CIERA_LINKLAB_CC \
  "$here/linklab-agent.sh" "$@" &
# mpirun runs in the background so that a SIGINT, SIGTERM or SIGHUP to this script (ciera bench's or ciera
# train's launcher passing one on) reaches it at once: bash runs a trap only once its foreground
# child has ended, and a SIGKILL after waiting for that would leave mpirun, its ranks and the
# namespaces behind. mpirun passes SIGTERM on to the ranks; teardown then removes the namespaces.
child=$!
wait "$child"
