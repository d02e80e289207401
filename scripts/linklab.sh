#!/usr/bin/env bash
# Link lab: honest network-bound measurements on one machine.
#
#   linklab.sh --ranks W [--gbit G] [--delay-ms D] [--keep] -- COMMAND [ARGS...]
#   linklab.sh --nodes K --ranks-per-node R [--ranks K*R] [--gbit G] [--delay-ms D] [--keep] -- ...
#
# Flat (--ranks W, or R = 1): W+1 network namespaces of its own, one per rank (ciera<id>-r<k>,
# address 10.231.0.<k+1>/24) and a hub (ciera<id>-hub, 10.231.0.254) holding a Linux bridge;
# every rank joins the bridge through a veth pair, its own link: every rank is its own node.
# <id> is this script's PID and its start time (<pid>-<ticks since boot>, /proc/PID/stat), which
# no later process given the same PID shares: a lab never meets another's names.
# Two-level (--nodes K --ranks-per-node R, R > 1; W = K*R): each node also gets a namespace
# (ciera<id>-n<n>) holding a bridge; the node's R ranks (n*R .. n*R+R-1, in mpirun's rank order)
# join it through unshaped veth pairs, and the node bridge joins the hub through one veth pair,
# the node's uplink (its NIC), which all its ranks share. Ranks and hub keep the addresses above.
#
# With --gbit, both directions of every uplink (flat: every rank's link) are shaped with `tc tbf`
# to G Gbit/s (a full-duplex NIC of that speed), B_inter per node as in docs/simulator.md;
# --delay-ms adds netem delay there. COMMAND then runs under Open MPI over TCP only, one rank per
# namespace: mpirun (CIERA_LINKLAB_MPIRUN when set, as `ciera bench` sets it to the mpirun it was
# built with; else mpirun from PATH) starts the ranks from the hub and linklab-agent.sh moves each
# into its namespace before COMMAND starts; the ranks reach mpirun's PMIx server over TCP at the
# hub's address (PMIX_MCA_ptl_tcp_if_include below).
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
# on failure or Ctrl-C: each namespace is listed for removal before it is created, so a signal
# at any point of the set-up leaves none. On SIGINT, SIGTERM or SIGHUP mpirun gets SIGTERM (and
# SIGCONT) and 15 s to end its ranks; then every process left in the lab's namespaces is killed,
# the namespaces are removed, and the lab exits 130, 143 or 129 (128 + the signal). A SIGKILL to
# this script cannot be cleaned up after: the next lab removes the namespaces of labs whose
# script no longer runs (names of this pattern only; labs whose script runs are left alone).
#
# Exit status: COMMAND's (mpirun's), 2 for a command line it cannot use, 77 where this machine
# cannot host the lab (not root, no ip, tc or mpirun, no network namespaces, no netem for
# --delay-ms: the tests skip), 1 when setting the lab up failed otherwise (the line says which
# step). Needs root (CAP_NET_ADMIN), iproute2 and Open MPI.
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
# What this machine must have, each checked (77: it cannot host the lab; the tests skip).
mpirun=${CIERA_LINKLAB_MPIRUN:-mpirun}
missing=()
[[ $(id -u) -eq 0 ]] || missing+=("root (CAP_NET_ADMIN; this is uid $(id -u))")
command -v ip >/dev/null || missing+=("ip (iproute2)")
command -v tc >/dev/null || missing+=("tc (iproute2)")
command -v "$mpirun" >/dev/null || missing+=("$mpirun (Open MPI)")
if [[ ${#missing[@]} -gt 0 ]]; then
  needs=$(printf '%s, ' "${missing[@]}")
  echo "linklab: cannot set up the lab here: it needs ${needs%, }" >&2
  exit 77
fi

here=$(cd "$(dirname "$0")" && pwd)
# The start time (clock ticks since boot) of process $1, which with its PID names it for good.
start_time() {
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  stat=${stat##*) }  # the command name may hold spaces and parentheses
  local fields
  read -ra fields <<<"$stat"
  echo "${fields[19]}"
}
id="$$-$(start_time $$)"
hub="ciera${id}-hub"
subnet="10.231.0"

# Namespaces left by labs whose script no longer runs (killed by SIGKILL, or a machine's crash):
# removed, so that their names and addresses are not in anyone's way. Only this script's own
# names: ciera<pid>-<start>-{hub,r<k>,n<n>}, a lab whose process <pid> is gone or is another
# process now (its start time differs); and those of earlier versions of this script,
# ciera<pid>-{hub,r<k>,n<n>} and ciera-probe-<pid>, whose <pid> no longer runs.
clear_stale() {
  local ns pid start now cleared=()
  for ns in $(ip netns list 2>/dev/null | awk '{ print $1 }'); do
    if [[ $ns =~ ^ciera([0-9]+)-([0-9]+)-(hub|r[0-9]+|n[0-9]+)$ ]]; then
      pid=${BASH_REMATCH[1]} start=${BASH_REMATCH[2]}
      now=$(start_time "$pid") && [[ $now == "$start" ]] && continue
    elif [[ $ns =~ ^ciera([0-9]+)-(hub|r[0-9]+|n[0-9]+)$ || $ns =~ ^ciera-probe-([0-9]+)$ ]]; then
      [[ -e /proc/${BASH_REMATCH[1]} ]] && continue
    else
      continue
    fi
    ip netns delete "$ns" 2>/dev/null && cleared+=("$ns")
  done
  # Not "linklab: ...", which `ciera train` takes for the lab's refusal when a run fails.
  if [[ ${#cleared[@]} -gt 0 ]]; then
    echo "linklab removed ${#cleared[@]} namespaces left by labs that no longer run: ${cleared[*]}" >&2
  fi
  return 0
}
clear_stale

namespaces=()      # every namespace of this lab, listed before it is created
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

# Every process in the lab's namespaces: mpirun (in the hub), its ranks (each in its own).
lab_pids() {
  local ns
  for ns in "${namespaces[@]}"; do ip netns pids "$ns" 2>/dev/null || true; done
}

# SIGKILL to every process in the lab's namespaces, however they have been reparented.
kill_lab() {
  local pass pids
  for pass in 1 2 3; do
    pids=$(lab_pids)
    [[ -n $pids ]] || return 0
    kill -KILL $pids 2>/dev/null || true
    sleep 0.1
  done
}

started=0          # 1 from just before mpirun starts
child=             # mpirun, once started
grace_s=15         # what mpirun gets to end its ranks after a signal (ciera bench waits 30 s)
ending=0           # 1 once a signal or the exit has begun ending the lab

teardown() {
  local status=$?
  ending=1
  trap '' INT TERM HUP  # a second signal must not cut the removal short
  if [[ $counting -eq 1 ]]; then report_counters || true; fi
  if [[ $keep -eq 0 ]]; then
    # Whatever of COMMAND outlived mpirun would keep its namespace (and links) up unnamed.
    [[ $started -eq 0 ]] || kill_lab
    for ns in "${namespaces[@]}"; do ip netns delete "$ns" 2>/dev/null || true; done
  fi
  exit "$status"
}

# SIGINT, SIGTERM, SIGHUP: mpirun (when started) gets SIGTERM, which it passes on to the ranks,
# and grace_s to end them; then everything in the namespaces is killed. Exits 128 + the signal.
on_signal() {  # status
  # Teardown has begun (it ignores signals from its first line on; FUNCNAME covers the moment
  # before that line): an `exit` here would end it halfway.
  if [[ $ending -eq 1 || " ${FUNCNAME[*]} " == *" teardown "* ]]; then return 0; fi
  ending=1
  trap '' INT TERM HUP
  if [[ -n $child ]]; then
    kill -TERM "$child" 2>/dev/null || true
    kill -CONT "$child" $(lab_pids) 2>/dev/null || true  # a stopped rank takes the signal too
    local i
    for ((i = 0; i < grace_s * 10; i++)); do
      kill -0 "$child" 2>/dev/null || break  # bash reaps it (SIGCHLD) while `sleep` runs
      sleep 0.1
    done
    if kill -0 "$child" 2>/dev/null; then
      echo "linklab: mpirun did not end its ranks within ${grace_s} s; killing them" >&2
      exec 3>&2 2>/dev/null  # not bash's own line for a job killed (the command line, whole)
      kill_lab
      wait "$child" || true
      exec 2>&3 3>&-
    fi
    wait "$child" 2>/dev/null || true
  fi
  exit "$1"
}

# A set-up step that fails: one line naming it (status 1), instead of ip's bare message alone.
setup_failed() {  # status command
  [[ $BASHPID -eq $$ && $ending -eq 0 ]] || return 0  # once, in the script itself
  if (($1 > 128)); then exit "$1"; fi  # killed by a signal: the signal's trap says it
  echo "linklab: setting up the lab failed: \`$2\` exited with status $1 (the lab is removed)" >&2
  exit 1
}
trap teardown EXIT
trap 'on_signal 130' INT
trap 'on_signal 143' TERM
trap 'on_signal 129' HUP
set -E  # the ERR trap in functions too
trap 'setup_failed $? "$BASH_COMMAND"' ERR

# tbf needs a bucket that covers a few milliseconds at the rate (and at least a 64 KiB GSO packet).
shape() {  # namespace device
  local ns=$1 dev=$2
  is_zero "$gbit" && return 0
  local bytes_per_s burst
  bytes_per_s=$(awk -v g="$gbit" 'BEGIN { printf "%d", g * 1e9 / 8 }')
  burst=$(awk -v b="$bytes_per_s" 'BEGIN { x = b / 400; if (x < 131072) x = 131072; printf "%d", x }')
  if ! is_zero "$delay_ms"; then
    # 77 like the checks above: this machine cannot host the lab asked for.
    ip netns exec "$ns" tc qdisc add dev "$dev" root handle 1: netem delay "${delay_ms}ms" ||
      { echo "linklab: netem is unavailable (kernel module sch_netem); run without --delay-ms" >&2; exit 77; }
    ip netns exec "$ns" tc qdisc add dev "$dev" parent 1:1 handle 10: tbf rate "${gbit}gbit" burst "$burst" latency 50ms
  else
    ip netns exec "$ns" tc qdisc add dev "$dev" root tbf rate "${gbit}gbit" burst "$burst" latency 50ms
  fi
}

# Listed before it is created: a signal while `ip netns add` runs (its trap runs once ip has
# ended) finds it listed, and deleting one never created is harmless. The first one made is the
# probe: failing for another reason than its name, namespaces are not permitted here (77).
add_namespace() {  # name
  local err
  namespaces+=("$1")
  if ! err=$(ip netns add "$1" 2>&1); then
    unset 'namespaces[-1]'  # not ours to remove
    if [[ $err == *"File exists"* ]]; then
      echo "linklab: network namespace $1 exists already (ip: $err); lab names are unique to a" \
           "running lab, so another process made it: remove it with \`ip netns delete $1\`" >&2
      exit 1
    fi
    if [[ ${#namespaces[@]} -eq 0 ]]; then
      echo "linklab: network namespaces are not permitted here (ip netns add: $err)" >&2
      exit 77
    fi
    echo "linklab: setting up the lab failed: ip netns add $1: $err" >&2
    exit 1
  fi
  ip netns exec "$1" ip link set lo up
}

add_bridge() {  # namespace
  ip netns exec "$1" ip link add br0 type bridge
  ip netns exec "$1" ip link set br0 up
}

# Rank r's namespace, its eth0 joined to the bridge in `switch_ns` through a veth pair whose
# other end is `switch_dev`. `ip link add ... netns` makes each end in its namespace, where the
# name need only be unique there (at most 15 characters): the lab's own names need no <id>.
add_rank() {  # rank switch_ns switch_dev
  local r=$1 switch_ns=$2 switch_dev=$3 ns="ciera${id}-r$1"
  add_namespace "$ns"
  ip link add eth0 netns "$ns" type veth peer name "$switch_dev" netns "$switch_ns"
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
    add_rank "$r" "$hub" "chr${r}"
    uplink_ns+=("ciera${id}-r${r}")
    uplink_dev+=(eth0)
    uplink_hub_dev+=("chr${r}")
  done
else
  for ((n = 0; n < nodes; n++)); do
    node_ns="ciera${id}-n${n}"
    add_namespace "$node_ns"
    add_bridge "$node_ns"
    ip link add "cun${n}" netns "$node_ns" type veth peer name "chn${n}" netns "$hub"
    ip netns exec "$node_ns" ip link set "cun${n}" master br0
    ip netns exec "$node_ns" ip link set "cun${n}" up
    ip netns exec "$hub" ip link set "chn${n}" master br0
    ip netns exec "$hub" ip link set "chn${n}" up
    uplink_ns+=("$node_ns")
    uplink_dev+=("cun${n}")
    uplink_hub_dev+=("chn${n}")
    for ((j = 0; j < per_node; j++)); do
      add_rank "$((n * per_node + j))" "$node_ns" "cnr$((n * per_node + j))"
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
trap - ERR  # from here on a failure is COMMAND's, and its status the lab's
set +E
started=1
# `exec` keeps the PID: CIERA_LINKLAB_HUB_PID is mpirun's, a process in the hub's namespace.
ip netns exec "$hub" env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
  CIERA_LINKLAB_GBIT="$gbit" CIERA_LINKLAB_DELAY_MS="$delay_ms" \
  CIERA_LINKLAB_NODES="$nodes" CIERA_LINKLAB_RANKS_PER_NODE="$per_node" \
  CIERA_LINKLAB_UPLINKS="$uplinks" CIERA_LINKLAB_CC="$cc" \
  PMIX_MCA_ptl_tcp_if_include="${subnet}.0/24" \
  bash -c 'export CIERA_LINKLAB_HUB_PID=$$; exec "$@"' linklab-hub \
  "$mpirun" --allow-run-as-root --oversubscribe -np "$ranks" \
  --mca btl tcp,self --mca btl_tcp_if_include "${subnet}.0/24" \
  --mca mpi_yield_when_idle 1 \
  -x CIERA_LINKLAB_PREFIX -x CIERA_LINKLAB_GBIT -x CIERA_LINKLAB_DELAY_MS \
  -x CIERA_LINKLAB_NODES -x CIERA_LINKLAB_RANKS_PER_NODE -x CIERA_LINKLAB_UPLINKS \
  -x CIERA_LINKLAB_HUB_PID -x CIERA_LINKLAB_CC \
  "$here/linklab-agent.sh" "$@" &
# mpirun runs in the background so that a SIGINT, SIGTERM or SIGHUP to this script (ciera bench's or ciera
# train's launcher passing one on) reaches it at once: bash runs a trap only once its foreground
# child has ended. on_signal passes it on (SIGTERM), bounded by grace_s; teardown then removes
# the namespaces. (A signal just before child is set skips the grace: teardown kills whatever
# mpirun started, which is all in the lab's namespaces.)
child=$!
wait "$child"
