"""torch.distributed's single-tensor collectives under the names the installed torch has: 2.13
calls them ``all_gather_single`` / ``reduce_scatter_single`` and warns (FutureWarning) at every
call of the old ``all_gather_into_tensor`` / ``reduce_scatter_tensor``; older releases (the GPU
image's 2.11) have only the old names. Same arguments either way."""

import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
