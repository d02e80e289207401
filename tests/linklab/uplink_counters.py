#!/usr/bin/env python3
"""The link lab's uplink byte counters count inter-node traffic and only that.

    uplink_counters.py LINKLAB_SH

Runs scripts/linklab.sh twice with CIERA_LINKLAB_COUNTERS set: two nodes of two ranks, and flat
(three ranks, each its own node). In each, some ranks send a known number of bytes over TCP to
ranks on the same node (4x as many as the rest, so any of it on an uplink would break the bounds
below) and others to ranks on other nodes. The counters file must then show, for every node, at
least the inter-node payload it sent and received, and no more than that plus header and ACK
overhead. Each rank first binds its listening socket to 10.231.0.<rank+1> (which only succeeds in
its own namespace) and checks the CIERA_LINKLAB_NODES / _RANKS_PER_NODE / _CC it was given, so
rank placement is checked too. Every sender checks its connection's TCP congestion control:
CUBIC, the lab's own (whatever the host's default), in the two-level run; Reno, chosen by
CIERA_LINKLAB_CC, in the flat one. Exit 77 (skipped) where the lab cannot run.

Run by mpirun inside the lab (OMPI_COMM_WORLD_RANK set), the same file is one rank:
    uplink_counters.py --rank NODES RANKS_PER_NODE PLAN CC   (PLAN: src:dst:bytes,...)
"""
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

PORT = 47123
INTER_BYTES = 4 << 20
INTRA_BYTES = 4 * INTER_BYTES


def address(rank: int) -> str:
    return f"10.231.0.{rank + 1}"


def parse_plan(text: str) -> list[tuple[int, int, int]]:
    return [tuple(int(x) for x in flow.split(":")) for flow in text.split(",")]


def receive(listener: socket.socket, senders: dict[int, int], failures: list[str]) -> None:
    """Accepts one connection from each sender; each sends its rank (4 bytes), then its bytes."""
    for _ in senders:
        conn, _ = listener.accept()
        with conn:
            header = b""
            while len(header) < 4:
                header += conn.recv(4 - len(header))
            sender = int.from_bytes(header, "little")
            got = 0
            while chunk := conn.recv(1 << 20):
                got += len(chunk)
            if senders.get(sender) != got:
                failures.append(f"from rank {sender}: {got} bytes, expected {senders.get(sender)}")


def send(me: int, peer: int, count: int, cc: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            conn = socket.create_connection((address(peer), PORT), timeout=60)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with conn:
        used = conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
        used = used.split(b"\0")[0].decode()
        if used != cc:
            raise SystemExit(f"rank {me}: its connection to rank {peer} uses TCP congestion "
                             f"control {used}, expected {cc}")
        conn.sendall(me.to_bytes(4, "little"))
        block = bytes(1 << 20)
        while count > 0:
            conn.sendall(block[: min(count, len(block))])
            count -= min(count, len(block))
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)  # the receiver's close: everything arrived


def run_rank(nodes: int, per_node: int, plan: list[tuple[int, int, int]], cc: str) -> int:
    me = int(os.environ["OMPI_COMM_WORLD_RANK"])
    seen = (os.environ.get("CIERA_LINKLAB_NODES"), os.environ.get("CIERA_LINKLAB_RANKS_PER_NODE"),
            os.environ.get("CIERA_LINKLAB_CC"))
    if seen != (str(nodes), str(per_node), cc):
        print(f"rank {me}: CIERA_LINKLAB_NODES/_RANKS_PER_NODE/_CC are {seen}, "
              f"expected {(nodes, per_node, cc)}", file=sys.stderr)
        return 1
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((address(me), PORT))  # fails outside namespace ciera<id>-r<me>
    except OSError as e:
        print(f"rank {me}: cannot bind {address(me)}: {e} (not in its own namespace?)", file=sys.stderr)
        return 1
    listener.listen()
    senders = {src: count for src, dst, count in plan if dst == me}
    failures: list[str] = []
    receiver = threading.Thread(target=receive, args=(listener, senders, failures))
    receiver.start()
    for src, dst, count in plan:
        if src == me:
            send(me, dst, count, cc)
    receiver.join()
    for failure in failures:
        print(f"rank {me}: {failure}", file=sys.stderr)
    return 1 if failures else 0


def check_lab(linklab: str, topology: list[str], nodes: int, per_node: int,
              plan: list[tuple[int, int, int]], cc: str | None = None) -> list[str]:
    """Runs the plan in the lab (CIERA_LINKLAB_CC=cc if given); returns what the counters file got
    wrong (77: skip)."""
    with tempfile.TemporaryDirectory() as tmp:
        counters_file = os.path.join(tmp, "counters.json")
        env = dict(os.environ, CIERA_LINKLAB_COUNTERS=counters_file)
        env.pop("CIERA_LINKLAB_CC", None)
        if cc is not None:
            env["CIERA_LINKLAB_CC"] = cc
        plan_text = ",".join(f"{s}:{d}:{c}" for s, d, c in plan)
        cmd = [linklab, *topology, "--gbit", "1", "--", sys.executable, os.path.abspath(__file__),
               "--rank", str(nodes), str(per_node), plan_text, cc or "cubic"]
        print("+", " ".join(cmd), flush=True)
        status = subprocess.run(cmd, env=env, timeout=300).returncode
        if status == 77:
            sys.exit(77)
        if status != 0:
            return [f"the lab exited with status {status}"]
        with open(counters_file) as f:
            counters = json.load(f)
    print(json.dumps(counters), flush=True)
    problems = []
    if (counters["nodes"], counters["ranks_per_node"], counters["gbit"]) != (nodes, per_node, 1):
        problems.append(f"header is {counters}, expected nodes {nodes}, ranks_per_node {per_node}, gbit 1")
    node_of = lambda rank: rank // per_node
    for uplink in counters["uplinks"]:
        n = uplink["node"]
        sent = sum(c for s, d, c in plan if node_of(s) == n and node_of(d) != n)
        received = sum(c for s, d, c in plan if node_of(d) == n and node_of(s) != n)
        # Payload is a floor; frame headers (~5%), ACKs for what the node received (~2%) and
        # ARP stay well under the bound, and a single intra-node flow leaking would exceed it.
        for what, got, payload, acked in (("tx", uplink["tx_bytes"], sent, received),
                                          ("rx", uplink["rx_bytes"], received, sent)):
            ceiling = payload * 1.15 + acked * 0.15 + (64 << 10)
            if not payload <= got <= ceiling:
                problems.append(f"node {n} {what}_bytes {got}: expected {payload} of payload "
                                f"and at most {int(ceiling)}")
    if sorted(u["node"] for u in counters["uplinks"]) != list(range(nodes)):
        problems.append(f"uplinks are {counters['uplinks']}, expected nodes 0..{nodes - 1}")
    return problems


def main() -> int:
    if sys.argv[1:2] == ["--rank"]:
        return run_rank(int(sys.argv[2]), int(sys.argv[3]), parse_plan(sys.argv[4]), sys.argv[5])
    linklab = sys.argv[1]
    problems = []
    # Two nodes of two: ranks 0,1 on node 0, ranks 2,3 on node 1.
    problems += check_lab(linklab, ["--nodes", "2", "--ranks-per-node", "2"], 2, 2,
                          [(1, 0, INTRA_BYTES), (3, 2, INTRA_BYTES), (2, 0, INTER_BYTES)])
    # Flat: every rank its own node, so every flow is inter-node; rank 2 stays idle.
    problems += check_lab(linklab, ["--ranks", "3"], 3, 1, [(1, 0, INTER_BYTES)], cc="reno")
    for problem in problems:
        print("FAIL:", problem)
    if not problems:
        print("uplink counters: inter-node bytes on the uplinks, intra-node bytes off them")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
