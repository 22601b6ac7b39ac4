"""
FSDP without a whole model on any rank: the model is built on the meta device (no storage), sharded
with FSDP2, then given storage for this rank's shards only, and their values. (Its checkpoints, sharded
too: depthres/checkpoint.py.)
"""

import torch

from model import InitialWeights
from model_fast import make_model


def sharded_model(mc, seed, dist, weights=None, init=True):
    """A GPT sharded over dist's ranks (FSDP2's fully_shard), each rank holding only its shards. Every
    sublayer (attention, MLP) is a unit of its own, the root holds the rest (embedding, head, the residual
    variant's routing parameters): sublayers, not Blocks, because GPT.forward calls block.attn and
    block.mlp, never a Block's own forward, where FSDP2's hooks would sit.

    The values are model.InitialWeights' for the seed, bit for bit what one process initialises (each
    parameter is generated whole on the CPU, one at a time, and this rank's shard cut out of it), or,
    resuming from a whole checkpoint, its `weights` (a state_dict, under today's names:
    checkpoint.load_checkpoint); init=False leaves them unset (a sharded checkpoint is loaded into them
    next). The rotary tables, buffers every rank keeps whole, are computed again. The largest tensor a
    rank ever holds whole is one parameter (or the residual module's routing parameters, which
    InitialWeights makes together: small)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    with torch.device("meta"):
        model = make_model(mc, seed=seed)  # parameters without storage; GPT leaves their values to us
    mesh = init_device_mesh(dist.device.type, (dist.world_size,))
    for block in model.blocks:
        fully_shard(block.attn, mesh=mesh)
        fully_shard(block.mlp, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=dist.device)  # storage for this rank's shards (and the buffers), uninitialised
    model.init_buffers()
    if weights is None and not init:
        return model
    values = InitialWeights(mc, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            whole = values(name, p.shape) if weights is None else weights[name]
            # every rank has the same whole tensor: each keeps its own shard, without communication
            p.copy_(distribute_tensor(whole.to(dist.device), p.device_mesh, p.placements, src_data_rank=None))
    return model
