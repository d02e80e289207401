#!/usr/bin/env bash
# Runs one rank of a link-lab job inside that rank's network namespace (see linklab.sh): mpirun
# starts every rank locally with this wrapper, which moves it into ciera<id>-r<rank> before the
# real program starts. Open MPI's launcher talks to the rank over Unix sockets, which network
# namespaces do not affect; the TCP BTL then sees only the rank's shaped link.
set -euo pipefail
rank=${OMPI_COMM_WORLD_RANK:?linklab-agent.sh runs as an mpirun rank}
exec ip netns exec "${CIERA_LINKLAB_PREFIX:?linklab-agent.sh runs under linklab.sh}-r${rank}" "$@"
