"""
FSDP without a whole model on any rank: meta-device initialisation.

    sharded_model(mc, seed, dist, weights=None)
        The model built on the meta device (no storage), sharded by distributed.shard (fully_shard),
        then given storage for this rank's shards only, and their values: model.InitialWeights' for
        the seed, bit for bit what one process initialises (each parameter is generated whole on the
        CPU, one at a time, and this rank's shard cut out of it), or, resuming from a whole checkpoint,
        its `weights` (a state_dict). The rotary tables, buffers every rank keeps whole, are computed
        again. The largest tensor a rank ever holds whole is one parameter (or the residual module's
        routing parameters, which InitialWeights makes together: small).
"""

import torch

from depthres.distributed import shard
from model import GPT, InitialWeights


def sharded_model(mc, seed, dist, weights=None):
    """A GPT sharded over dist's ranks (FSDP2), each rank holding only its shards; see the module's doc."""
    from torch.distributed.tensor import distribute_tensor

    with torch.device("meta"):
        model = GPT(mc, seed=seed)  # parameters without storage; GPT leaves their values to us
    shard(model, dist)
    model.to_empty(device=dist.device)  # storage for this rank's shards (and the buffers), uninitialised
    model.init_buffers()
    init = InitialWeights(mc, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            whole = init(name, p.shape) if weights is None else weights[name]
            # every rank has the same whole tensor: each keeps its own shard, without communication
            p.copy_(distribute_tensor(whole.to(dist.device), p.device_mesh, p.placements, src_data_rank=None))
    return model
