"""
How the ranks of a torchrun job share one run: DDP (the default) or FSDP2 (fsdp=true).

    DDP     every rank holds the whole model and AdamW state; gradients are all-reduced. About 16
            bytes per parameter on every GPU (4 weight, 4 gradient, 8 AdamW), before activations.
    FSDP2   torch.distributed.fsdp.fully_shard (sharded_model): every sublayer's parameters,
            gradients and AdamW state are split across the N ranks (16 / N bytes per parameter), each
            sublayer's whole weights gathered just before it runs and freed after; gradients are
            reduce-scattered. On CPUs, large allocations are then mapped on their own
            (map_large_allocations), so what FSDP frees at every step leaves the resident set instead
            of staying in glibc's heap. FSDP2's modules and sharded tensors are told apart here by their
            methods, so a run without it never imports it (a second of start-up).

Both compute the same training step in float32 parameters under the same autocast (no mixed-
precision policy: the depth-routing parameters and math stay float32 exactly as under DDP). They
sum gradients in a different order (an all-reduce against a reduce-scatter), so their numbers agree
to float32 rounding, not bit for bit. A DDP run's checkpoint is one file of the whole state, an FSDP
run's a sharded one (depthres/checkpoint.py); one process, DDP and FSDP runs resume from either.
"""

import ctypes
import inspect
import os
import platform
import resource
import sys
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist
from torch.nn.parallel import DistributedDataParallel

from depthres import UserError
from model import InitialWeights
from model_fast import make_model


@dataclass
class Dist:
    rank: int
    world_size: int
    device: torch.device
    objects: object = None  # the process group that carries Python objects (on the CPU); None: the default one

    @property
    def master(self):
        return self.rank == 0


def launch_env():
    """(rank, world_size, local_rank) from torchrun's environment, checked: (0, 1, 0) without it. A
    WORLD_SIZE above 1 without the rest of what torchrun sets (a stray export in a shell, say) is one
    UserError line, before anything starts."""
    env = os.environ

    def number(name, default, low):
        value = env.get(name)
        if value is None:
            return default
        try:
            n = int(value)
        except ValueError:
            n = None
        if n is None or n < low:
            raise UserError(f"{name}={value!r} in the environment is not a whole number >= {low}: torchrun sets it "
                            f"for each rank; unset it to train in one process")
        return n

    world_size, rank, local_rank = number("WORLD_SIZE", 1, 1), number("RANK", 0, 0), number("LOCAL_RANK", 0, 0)
    if world_size > 1:
        missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
        if missing:
            raise UserError(f"WORLD_SIZE={world_size} is set in the environment, but {', '.join(missing)} "
                            f"{'is' if len(missing) == 1 else 'are'} not: start the ranks with torchrun "
                            f"(torchrun --nproc_per_node={world_size} train.py ...), or unset WORLD_SIZE to train "
                            "in one process")
    if rank >= world_size:
        raise UserError(f"RANK={rank} in the environment is not below WORLD_SIZE={world_size}: start the ranks "
                        "with torchrun, or unset RANK to train in one process")
    return rank, world_size, local_rank


def wants_cuda(device):
    """Whether the device key ("auto", "cpu" or "cuda") asks for CUDA: "cuda", or "auto" where it is available."""
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def setup_distributed(device):
    """Rank, world size and device from torchrun's environment (one process without it)."""
    rank, world_size, local_rank = launch_env()
    cuda = wants_cuda(device)
    if cuda and not torch.cuda.is_available():
        raise UserError("device=cuda, but CUDA is not available")
    dev = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:  # float32 matmuls stay float32 (no TF32): the depth routing and the loss are computed in float32
        torch.cuda.set_device(dev)
    objects = None
    if world_size > 1:
        torch_dist.init_process_group("nccl" if cuda else "gloo")
        if cuda:  # objects (the checkpoint rank 0 reads, errors) go through host memory, not a GPU buffer
            objects = torch_dist.new_group(backend="gloo")
    return Dist(rank, world_size, dev, objects)


def agreed(dist, fn):
    """fn() on this rank, its error shared: when fn raises a UserError on any rank, every rank
    raises the first such error, so all of them exit with the same line instead of waiting on the others."""
    try:
        result, error = fn(), None
    except UserError as e:
        result, error = None, e
    error = next((e for e in per_rank(dist, error) if e is not None), None)
    if error is not None:
        raise error
    return result


NODE_LOCAL_KEYS = ("out_dir", "data_dir", "resume")  # may differ between ranks: paths on a node's own disk


def check_same_keys(dist, keys):
    """Every rank was started with rank 0's keys (but NODE_LOCAL_KEYS): else, on every rank, one UserError
    line that names the first rank that differs and how (before any compute: ranks that train different
    models or lrs would otherwise train silently, or fail in a collective with a torch traceback)."""
    everyone = per_rank(dist, keys)
    for r, theirs in enumerate(everyone[1:], 1):
        differ = [k for k, v in everyone[0].items() if k not in NODE_LOCAL_KEYS and theirs.get(k) != v]
        if differ:
            raise UserError(f"rank {r} was started with other keys than rank 0 ("
                              + "; ".join(f"{k} {theirs.get(k)!r} here, {everyone[0][k]!r} on rank 0" for k in differ)
                              + "): start every rank with the same config and keys")


def from_rank0(dist, obj):
    """Rank 0's `obj` on every rank."""
    if dist.world_size == 1:
        return obj
    box = [obj]
    torch_dist.broadcast_object_list(box, src=0, group=dist.objects)
    return box[0]


def any_rank(dist, value):
    """The largest of the ranks' values (a float), the same on every rank."""
    t = torch.full((), float(value), device=dist.device)
    if dist.world_size > 1:
        torch_dist.all_reduce(t, op=torch_dist.ReduceOp.MAX)
    return t.item()


def per_rank(dist, obj):
    """Every rank's `obj` (any picklable value), in rank order, on every rank (a collective)."""
    if dist.world_size == 1:
        return [obj]
    everyone = [None] * dist.world_size
    torch_dist.all_gather_object(everyone, obj, group=dist.objects)
    return everyone


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
MMAP_THRESHOLD = 128 * 1024  # glibc's initial threshold, kept fixed


def map_large_allocations():
    """glibc only (elsewhere nothing): every allocation of MMAP_THRESHOLD bytes or more is mapped on its
    own and returned to the system when freed, for the rest of the process. By default glibc raises its
    threshold to the largest block freed (up to 32 MB), and freed blocks below it stay in the heap, part
    of the resident set: FSDP frees each sublayer's gathered weights and gradients at every step, so its
    peak resident set would be about twice its live memory (docs/training.md, the memory rule). Call it
    before the large allocations; a MALLOC_MMAP_THRESHOLD_ in the environment is the user's choice, kept.
    Returns whether the threshold was set."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc" \
            or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        return ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    except (OSError, AttributeError):
        return False


def peak_memory(dist):
    """(the largest peak memory of any rank, each rank's peak), in bytes, a collective: on CUDA the peak of
    allocated tensors, on the CPU the process' peak resident set (its whole life: imports included)."""
    if dist.device.type == "cuda":
        mine = torch.cuda.max_memory_allocated(dist.device)
    else:
        mine = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    peaks = per_rank(dist, mine)
    return max(peaks), peaks


# ----------------------------------------------------------------------------------------------
# DDP and FSDP2.


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


# DDP's flag for broadcasting buffers before every forward (torch 2.13 renamed broadcast_buffers)
NO_BUFFER_SYNC = next(name for name in ("forward_sync_buffers", "broadcast_buffers")
                      if name in inspect.signature(DistributedDataParallel).parameters)


def ddp(model, dist):
    # the model's only buffers are the constant rotary tables: nothing to broadcast before every forward
    return DistributedDataParallel(model, device_ids=[dist.device.index] if dist.device.type == "cuda" else None,
                                   **{NO_BUFFER_SYNC: False})


def gradient_sync(model, on):
    """A context for one micro-step's backward: with on=False, the gradients stay local (accumulating
    on this rank), without DDP's all-reduce or FSDP2's reduce-scatter; the last micro-step syncs."""
    if hasattr(model, "set_requires_gradient_sync"):  # an FSDP2 module
        model.set_requires_gradient_sync(on)
        return nullcontext()
    return nullcontext() if on or not isinstance(model, DistributedDataParallel) else model.no_sync()


def local(t):
    """This rank's part of a tensor (the tensor itself unless it is a sharded DTensor)."""
    return t.to_local() if hasattr(t, "to_local") else t


def whole(t):
    """The whole tensor of a sharded DTensor (a collective: every rank calls it), else the tensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def state_bytes(model, optimizer):
    """Bytes of this rank's weights and optimizer state at rest: all of them under DDP, its shards under
    FSDP (whose root keeps its weights gathered after a forward until the next backward: resharded here)."""
    if hasattr(model, "reshard"):  # an FSDP2 module
        model.reshard()
    tensors = [*model.parameters(), *(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))]
    return sum(local(t).numel() * t.element_size() for t in tensors)


def load_optimizer_state(optimizer, state):
    """Load a whole optimizer state (ckpt.pt's) into an optimizer whose parameters may be sharded:
    each state tensor of a sharded parameter is sharded as that parameter is."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if hasattr(params[0], "device_mesh"):  # sharded DTensors
        from torch.distributed.tensor import distribute_tensor

        def like(p, v):
            return distribute_tensor(v.to(p.device), p.device_mesh, p.placements) \
                if torch.is_tensor(v) and v.shape == p.shape else v
        state = {"state": {i: {k: like(params[i], v) for k, v in s.items()} for i, s in state["state"].items()},
                 "param_groups": state["param_groups"]}
    optimizer.load_state_dict(state)
