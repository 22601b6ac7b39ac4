"""
FSDP without a whole model or a whole training state on any rank: meta-device initialisation and
sharded checkpoints.

    sharded_model(mc, seed, dist, weights=None)
        The model built on the meta device (no storage), sharded by distributed.shard (fully_shard),
        then given storage for this rank's shards only, and their values: model.InitialWeights' for
        the seed, bit for bit what one process initialises (each parameter is generated whole on the
        CPU, one at a time, and this rank's shard cut out of it), or, resuming from a whole checkpoint,
        its `weights` (a state_dict). The rotary tables, buffers every rank keeps whole, are computed
        again. The largest tensor a rank ever holds whole is one parameter (or the residual module's
        routing parameters, which InitialWeights makes together: small).

    A sharded checkpoint (an FSDP run's, instead of ckpt.pt) is a directory:
        run_dir/ckpt/        .metadata        torch.distributed.checkpoint's (DCP) index, written by rank 0
                             __R_0.distcp     rank R's shards of the weights and the AdamW state, written by rank R
                             state.pt         the rest of the run state (checkpoint.CKPT_KEYS but model,
                                              optimizer, checksum), written by rank 0
                             manifest.json    written last: format, step, world size, every other file's
                                              bytes and sha256 (each rank hashes the files it wrote)
    save_sharded writes it into run_dir/.ckpt.tmp/, then renames the previous ckpt/ to .ckpt.old/, the
    new one to ckpt/, and removes .ckpt.old/: at every instant ckpt/ or .ckpt.old/ is a whole
    checkpoint (a reader takes .ckpt.old/ when ckpt/ is missing), so a kill during a save keeps the
    previous one. load_sharded checks every file against the manifest (the ranks share the reading)
    and loads with DCP, which reshards: the checkpoint of N ranks loads on M ranks, on one process
    (no FSDP) and under DDP. Nothing in it is unpickled unsafely (_safe_dcp): the manifest's checksums
    guard against damage, not against someone who can rewrite the files, so a tampered .metadata or
    shard is refused, never executed. whole_checkpoint gathers it in one process, in ckpt.pt's format
    (tools/export_ckpt.py writes that file).
"""

import json
import os
import shutil
import warnings
from contextlib import suppress
from pathlib import Path

import torch

from depthres import UserError, os_error_message
from depthres.checkpoint import (
    CKPT_FORMAT,
    GONE,
    MANIFEST,
    NAME,
    OLD,
    RENAMED,
    RUN_FILES,
    SHARDED_FORMAT,
    STATE,
    STATE_KEYS,
    TMP,
    file_digest,
    locate,
    read_index,
    read_manifest,
    read_sharded,
    renamed,
    save_checkpoint,
    verify_files,
)
from depthres.config import model_config
from depthres.distributed import agreed, shard
from depthres.files import lock_dir, sync_dir, write_file, writing
from model import InitialWeights
from model_fast import make_model


def sharded_model(mc, seed, dist, weights=None, init=True):
    """A GPT sharded over dist's ranks (FSDP2), each rank holding only its shards; see the module's doc.
    init=False leaves the values unset (a sharded checkpoint is loaded into them next)."""
    from torch.distributed.tensor import distribute_tensor

    with torch.device("meta"):
        model = make_model(mc, seed=seed)  # parameters without storage; GPT leaves their values to us
    shard(model, dist)
    model.to_empty(device=dist.device)  # storage for this rank's shards (and the buffers), uninitialised
    model.init_buffers()
    if weights is None and not init:
        return model
    values = InitialWeights(mc, seed)  # weights: a checkpoint's, under today's names (checkpoint.load_checkpoint)
    with torch.no_grad():
        for name, p in model.named_parameters():
            whole = values(name, p.shape) if weights is None else weights[name]
            # every rank has the same whole tensor: each keeps its own shard, without communication
            p.copy_(distribute_tensor(whole.to(dist.device), p.device_mesh, p.placements, src_data_rank=None))
    return model


# ----------------------------------------------------------------------------------------------
# Which checkpoint a path names.


# ----------------------------------------------------------------------------------------------
# Loading and saving (reading what a run directory holds: depthres/checkpoint.py).


def _safe_dcp(path):
    """(storage reader, load planner) for dcp.load that unpickle nothing unsafely: torch's own read the index
    (.metadata) with plain pickle.load and the shards' non-tensor values (the AdamW hyperparameters) with
    torch.load(weights_only=False), so a tampered checkpoint (its manifest recomputed) could run code. Here
    the index goes through checkpoint.read_index and every value through torch.load(weights_only=True)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            index = read_index(path)
            index.storage_meta = index.storage_meta or StorageMeta()  # as FileSystemReader.read_metadata
            index.storage_meta.load_id = self.load_id
            return index

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            try:
                value = torch.load(value, weights_only=True)
            except Exception as e:  # torch's message advises weights_only=False, which is unsafe: not quoted
                raise UserError(f"{path} holds a value that is not plain data ({read_item.dest_index.fqn}: "
                                      f"{type(e).__name__} reading it): it was not written by train.py, or was "
                                      "altered after; use an intact copy or another checkpoint") from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], value)
            else:
                self.state_dict[read_item.dest_index.fqn] = value

    return Reader(path), Planner()


def load_sharded(path, model, optimizer, dist=None):
    """Load a sharded checkpoint's weights and AdamW state into `model` and `optimizer`, on every rank (a
    collective), sharded (FSDP2) or not, on any number of ranks: DCP reads each rank's part. Every file
    is checked against the manifest first, the ranks sharing the reading."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    files = read_manifest(path)["files"]
    rank, world = (dist.rank, dist.world_size) if dist is not None else (0, 1)
    mine = sorted(files)[rank::world]
    if dist is not None:
        agreed(dist, lambda: verify_files(path, mine, files))
    else:
        verify_files(path, mine, files)
    model_sd, optim_sd = get_state_dict(model, optimizer)  # this rank's tensors, filled in place
    state = {"model": model_sd, "optim": optim_sd}
    older = _older_names(path)
    alone = not torch.distributed.is_initialized()  # one process (no process group): said to DCP, which warns anyway
    reader, planner = _safe_dcp(path)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        state = _names(state, older)  # as the checkpoint names the parameters
        try:
            dcp.load(state, storage_reader=reader, planner=planner, no_dist=alone)
        except CheckpointException as e:  # raised on every rank: the first rank's error, its first line
            errors = [exc for exc, _ in getattr(e, "failures", {}).values()]
            first = errors[0] if errors else e  # (e's text holds each rank's remote traceback)
            why = next((line.strip() for line in str(first).splitlines() if line.strip()), "")
            raise next((x for x in errors if isinstance(x, UserError)), UserError(
                f"{path} cannot be loaded into this model ({type(first).__name__}: {why}); use an intact copy or "
                "another checkpoint")) from None
        state = _names(state, renamed)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _older_names(path):
    """name -> the name a sharded checkpoint written before checkpoint.RENAMED's renames gives it (or itself)."""
    keys = read_index(path).state_dict_metadata
    old = [(o, n) for o, n in RENAMED.items() if any(k.startswith("model." + o) for k in keys)]
    return lambda name: next((o + name.removeprefix(n) for o, n in old if name.startswith(n)), name)


def _names(state, rename):
    """A (model, optimizer) state dict with every parameter name in it (dict keys, param_groups'
    "params") passed through rename; the tensors are the same objects."""
    if isinstance(state, dict):
        return {_names(k, rename): _names(v, rename) for k, v in state.items()}
    if isinstance(state, list):
        return [_names(v, rename) for v in state]
    return rename(state) if isinstance(state, str) else state


# ----------------------------------------------------------------------------------------------
# Writing.


def _failed_save(e, tmp):
    """A DCP CheckpointException (raised on every rank) as one UserError line. torch reports a failed write
    of a shard as a RuntimeError ("[enforce fail at inline_container.cc...] file write failed"), without its
    errno: the cause is found from the file system and the file-size limit instead."""
    errors = [exc for exc, _ in getattr(e, "failures", {}).values()]
    os_errors = [exc for exc in errors if isinstance(exc, OSError)]
    if os_errors:
        return UserError(os_error_message(os_errors[0], tmp))
    import resource

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    with suppress(OSError):
        disk = os.statvfs(tmp.parent)
        if disk.f_bavail * disk.f_frsize < 1 << 20:
            return UserError(f"no space left on device writing {tmp}")
    if limit != resource.RLIM_INFINITY:
        return UserError(f"cannot write {tmp}: a shard would pass this process' file-size limit of {limit:,} "
                           "bytes (ulimit -f); raise it, or give the run more ranks")
    return UserError(f"cannot write {tmp}: writing a shard failed ({type(errors[0]).__name__ if errors else e}): "
                       "a full disk, a quota or a failing device")


def save_sharded(run_dir, model, optimizer, state, dist):
    """Write the sharded checkpoint of `model`, `optimizer` and the run `state` (STATE_KEYS) into
    run_dir/ckpt, every rank its own shards, atomically (see the module's doc); a collective. Removes a
    ckpt.pt it supersedes. Returns the checkpoint's path. A failed write on any rank is a UserError on
    every rank, the previous checkpoint kept and the partial new one removed."""
    run_dir = Path(run_dir)
    tmp, final = run_dir / TMP, run_dir / NAME

    def fresh():  # rank 0: an empty .ckpt.tmp (a killed save leaves one)
        with writing(tmp, UserError):
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
    agreed(dist, lambda: fresh() if dist.master else None)

    def visible():
        if not tmp.is_dir():
            raise UserError(f"rank {dist.rank} cannot see {tmp}: under FSDP every rank writes its shards into the "
                              "run directory, so out_dir must be on storage that every node shares")
    agreed(dist, visible)
    try:
        _write_sharded(tmp, model, optimizer, state, dist)
    except UserError:  # on every rank: rank 0 removes the partial shards (a full disk is left as it was)
        if dist.master:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    agreed(dist, lambda: _commit(run_dir) if dist.master else None)
    return final


def _write_sharded(tmp, model, optimizer, state, dist):
    """Every rank's shards, the run state and the manifest (rank 0), into tmp; a collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)  # DTensors: this rank's shards, nothing gathered
    try:
        dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True))
    except CheckpointException as e:
        raise _failed_save(e, tmp) from None

    def hash_mine():  # the files this rank wrote (DCP names them __<rank>_<n>.distcp)
        with writing(tmp, UserError):
            return {n: file_digest(tmp / n) for n in os.listdir(tmp) if n.startswith(f"__{dist.rank}_")}
    digests = agreed(dist, hash_mine)
    if dist.world_size > 1:
        gathered = [None] * dist.world_size
        torch.distributed.all_gather_object(gathered, digests, group=dist.objects)
        digests = {k: v for d in gathered for k, v in d.items()}

    def run_state():  # rank 0: the run state, the manifest last
        write_file(tmp / STATE, _saved(state), UserError)
        with writing(tmp, UserError):
            files = {n: digests.get(n) or file_digest(tmp / n) for n in sorted(os.listdir(tmp))}  # .metadata, state.pt
        manifest = {"format": SHARDED_FORMAT, "step": state["step"], "world_size": dist.world_size,
                    "torch": torch.__version__, "files": files}  # torch: whose DCP wrote the index
        write_file(tmp / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode(), UserError)
    agreed(dist, lambda: run_state() if dist.master else None)


def _commit(run_dir):
    """Rank 0: the whole new checkpoint (.ckpt.tmp) renamed into place, the previous one removed."""
    tmp, final, old = run_dir / TMP, run_dir / NAME, run_dir / OLD
    with writing(final, UserError):
        sync_dir(tmp)
        if final.is_dir():  # else .ckpt.old, if any, is the last checkpoint: kept until the new one is in place
            _discard(old)
            os.replace(final, old)
        os.replace(tmp, final)
        sync_dir(run_dir)
        _discard(old)  # (a ckpt/ that was a link: the link, never what it points to)
        (run_dir / "ckpt.pt").unlink(missing_ok=True)  # an older single file (a run resumed under FSDP)


def _saved(state):
    import io

    buf = io.BytesIO()
    torch.save({k: state[k] for k in STATE_KEYS}, buf)
    return buf.getvalue()


def remove_sharded(run_dir, checkpoint=True):
    """Remove the run directory's sharded checkpoint and any half-written one (a run replacing it, or a
    single-file checkpoint superseding it); checkpoint=False: only what a killed save or removal left. Each
    is renamed to .ckpt.gone first (one atomic rename; no reader looks there), then deleted: a kill in the
    deletion leaves no half-deleted ckpt/ beside the checkpoint that replaces it."""
    run_dir = Path(run_dir)
    gone = run_dir / GONE
    # .ckpt.old before ckpt: beside ckpt/ it is a leftover, and without ckpt/ it is the checkpoint
    for name in (TMP, OLD, NAME) if checkpoint else (TMP,):
        with writing(run_dir / name, UserError):
            _discard(gone)
            if (run_dir / name).exists() or (run_dir / name).is_symlink():
                os.replace(run_dir / name, gone)
    with writing(gone, UserError):
        _discard(gone)


def _discard(path):
    if path.is_symlink():  # (a link is removed, never followed)
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# One file.


def whole_checkpoint(path):
    """The single-file checkpoint dict (checkpoint.CKPT_KEYS but its checksum, which save_checkpoint adds)
    of a sharded checkpoint: its shards gathered in this process, the weights a model's state_dict, the
    optimizer state an AdamW's state_dict over model.param_groups, as one process saves them."""
    state = read_sharded(path)
    with torch.device("meta"):
        model = make_model(model_config(state["model_config"]))
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)  # each parameter given storage in place, so
    try:                                                         # tied ones (tie_embeddings) stay one
        model.to_empty(device="cpu")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    model.init_buffers()
    optimizer = torch.optim.AdamW(model.param_groups(state["train_config"]["weight_decay"]))  # its hyperparameters
    load_sharded(state["sharded"], model, optimizer)                                        # come from the checkpoint
    return {**{k: state[k] for k in STATE_KEYS}, "format": CKPT_FORMAT, "model": model.state_dict(),
            "optimizer": optimizer.state_dict(), "world_size": state["world_size"]}


def export(path, out=None, overwrite=False):
    """Write the sharded checkpoint that `path` (a run directory or the checkpoint's directory) names as one
    checksummed file, `out` or the run directory's ckpt.pt, under the lock of the run directory it writes into
    (not while that run runs). Never inside the run's checkpoints; over an existing file (but the run's own
    ckpt.pt) or into another run's directory only with `overwrite`. Returns (out, step)."""
    kind, found = locate(path, prefer_sharded=True)
    if kind != "sharded":
        raise UserError(f"{path} holds no sharded checkpoint" + (f" ({found} is one file already)"
                                                                     if found.exists() else ""))
    run_dir = found.parent
    out = Path(out) if out is not None else run_dir / "ckpt.pt"
    check_export_target(out, run_dir, overwrite)
    into = out.resolve().parent
    lock = lock_dir(into, "run", UserError) if (into / ".lock").exists() or any(
        (into / name).exists() for name in RUN_FILES) else None  # a run directory: not while a run holds it
    try:
        ckpt = whole_checkpoint(found)
        save_checkpoint(out, ckpt)
    finally:
        if lock is not None:
            lock.release()
    return out, ckpt["step"]


def check_export_target(out, run_dir, overwrite):
    """Where export may write: not a directory, nothing inside the run's checkpoints (ckpt/, .ckpt.old/,
    .ckpt.tmp/), and, unless `overwrite`, no existing file but the run's own ckpt.pt and no other run's
    directory (whose --resume=true would continue from the export)."""
    target, own = out.resolve(), (run_dir / "ckpt.pt").resolve()
    for name in (NAME, OLD, TMP):
        if (run_dir / name).resolve() in (target, *target.parents):
            raise UserError(f"--out {out} is inside the checkpoint being exported ({run_dir / name}): writing "
                                  f"it would destroy what it reads; write to {run_dir / 'ckpt.pt'} (the default) or "
                                  "outside the run directory")
    if out.is_dir():
        raise UserError(f"--out {out} is a directory: give the path of the file to write")
    if target == own or overwrite:
        return
    if out.exists() or out.is_symlink():
        raise UserError(f"--out {out} exists: pass --overwrite to replace it, or choose another path")
    held = [name for name in RUN_FILES if (target.parent / name).exists()]
    if held and target.parent != run_dir.resolve():
        raise UserError(f"--out {out} is in another run's directory ({', '.join(held)}): that run's "
                              "--resume=true would continue from this export; pass --overwrite if it should, or "
                              "choose another path")
