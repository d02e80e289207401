#!/usr/bin/env bash
# Runs one rank of a link-lab job inside that rank's network namespace (see linklab.sh): mpirun
# starts every rank locally with this wrapper, which moves it into ciera<id>-r<rank> before the
# real program starts. The rank reaches mpirun's PMIx server over TCP at the hub's address
# (10.231.0.254, through the rank's own link), and the TCP BTL sees only that link too.
set -euo pipefail
rank=${OMPI_COMM_WORLD_RANK:?linklab-agent.sh runs as an mpirun rank}
exec ip netns exec "${CIERA_LINKLAB_PREFIX:?linklab-agent.sh runs under linklab.sh}-r${rank}" "$@"
