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
    (no FSDP) and under DDP. whole_checkpoint gathers it in one process, in ckpt.pt's format
    (tools/export_ckpt.py writes that file).
"""

import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path

import torch

from depthres.checkpoint import CKPT_FORMAT, CheckpointError, RunDirError, save_checkpoint
from depthres.distributed import agreed, shard
from depthres.files import DirLock, os_error_message, sync_dir, write_file, writing
from model import GPT, GPTConfig, InitialWeights

SHARDED_FORMAT = "depthres-sharded-1"
NAME, TMP, OLD = "ckpt", ".ckpt.tmp", ".ckpt.old"  # in the run directory
MANIFEST, STATE = "manifest.json", "state.pt"
STATE_KEYS = ("format", "model_config", "tokenizer", "step", "train_config", "loader", "rng")
EXPORT = "python -m tools.export_ckpt"


def sharded_model(mc, seed, dist, weights=None, init=True):
    """A GPT sharded over dist's ranks (FSDP2), each rank holding only its shards; see the module's doc.
    init=False leaves the values unset (a sharded checkpoint is loaded into them next)."""
    from torch.distributed.tensor import distribute_tensor

    with torch.device("meta"):
        model = GPT(mc, seed=seed)  # parameters without storage; GPT leaves their values to us
    shard(model, dist)
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


# ----------------------------------------------------------------------------------------------
# Which checkpoint a path names.


def committed(run_dir):
    """The run directory's sharded checkpoint: ckpt/, or .ckpt.old/ between a save's two renames; or None."""
    for name in (NAME, OLD):
        if (Path(run_dir) / name).is_dir():
            return Path(run_dir) / name
    return None


def holds_checkpoint(run_dir):
    return (Path(run_dir) / "ckpt.pt").exists() or committed(run_dir) is not None


def locate(path, prefer_sharded):
    """("file" or "sharded", its path): the checkpoint that `path` names. A file is a single-file checkpoint;
    a directory with a manifest (or named ckpt) a sharded one; a run directory holds ckpt.pt, a sharded
    checkpoint, or both (after an export, or a kill just after a save): the one at the later step, and at
    the same step the sharded one if prefer_sharded (a resuming run), the file otherwise (a reader)."""
    path = Path(path)
    if not path.is_dir():
        return "file", path
    if (path / MANIFEST).exists() or path.name in (NAME, OLD):
        return "sharded", path
    sharded, file = committed(path), path / "ckpt.pt"
    if sharded is None:
        return "file", file
    if not file.exists():
        return "sharded", sharded
    s, f = _manifest(sharded)["step"], _file_step(file)
    return ("sharded", sharded) if s > f or (s == f and prefer_sharded) else ("file", file)


def _file_step(path):
    try:  # mapped: only the step is read
        return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["step"])
    except Exception:
        raise CheckpointError(f"{path} is not a readable checkpoint: it is truncated, corrupt or not a checkpoint; "
                              "use an intact copy or another checkpoint") from None


def export_advice(path):
    run_dir = path.parent if path.name in (NAME, OLD) else path
    return (f"{path} holds a sharded checkpoint (an FSDP run's {NAME}/): write it as one file with "
            f"`{EXPORT} {run_dir}`, then use {run_dir / 'ckpt.pt'}")


# ----------------------------------------------------------------------------------------------
# Reading and verifying.


def _manifest(path):
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        ok = manifest.get("format") == SHARDED_FORMAT and isinstance(manifest.get("files"), dict)
    except (OSError, ValueError, AttributeError):
        ok = False
    if not ok:
        raise CheckpointError(f"{path} is not a whole sharded checkpoint (its {MANIFEST} is missing or unreadable, "
                              f"or not of format {SHARDED_FORMAT!r}); use an intact copy or another checkpoint")
    return manifest


def _digest(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return {"bytes": os.path.getsize(path), "sha256": h.hexdigest()}


def _verify(path, names, files):
    """Each of `names` has the bytes and sha256 the manifest gives it."""
    for name in names:
        try:
            ok = _digest(path / name) == files[name]
        except OSError:
            ok = False
        if not ok:
            raise CheckpointError(f"{path / name} is missing or corrupt: its contents do not match the checksum in "
                                  f"{path / MANIFEST} (damaged on disk or in a copy); use an intact copy or another "
                                  "checkpoint")


def read_sharded(path):
    """The run state of a sharded checkpoint (checkpoint.CKPT_KEYS without model, optimizer and checksum),
    with "sharded": its directory. Checks the manifest, that every file it lists is there at its size,
    and state.pt's checksum; the shards' checksums are checked by load_sharded."""
    path = Path(path)
    manifest = _manifest(path)
    files = manifest["files"]
    short = [n for n, f in files.items() if not (path / n).is_file() or os.path.getsize(path / n) != f["bytes"]]
    if short:
        raise CheckpointError(f"{path} is incomplete: {', '.join(sorted(short))} missing or of the wrong size; "
                              "use an intact copy or another checkpoint")
    _verify(path, [STATE], files)
    state = torch.load(path / STATE, map_location="cpu", weights_only=True)
    if state.get("format") != CKPT_FORMAT or any(k not in state for k in STATE_KEYS):
        raise CheckpointError(f"{path / STATE} is not a run state of format {CKPT_FORMAT!r}")
    return {**state, "sharded": path}


def load_sharded(path, model, optimizer, dist=None):
    """Load a sharded checkpoint's weights and AdamW state into `model` and `optimizer`, on every rank (a
    collective), sharded (FSDP2) or not, on any number of ranks: DCP reads each rank's part. Every file
    is checked against the manifest first, the ranks sharing the reading."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    files = _manifest(path)["files"]
    rank, world = (dist.rank, dist.world_size) if dist is not None else (0, 1)
    mine = sorted(files)[rank::world]
    if dist is not None:
        agreed(dist, lambda: _verify(path, mine, files))
    else:
        _verify(path, mine, files)
    model_sd, optim_sd = get_state_dict(model, optimizer)  # this rank's tensors, filled in place
    state = {"model": model_sd, "optim": optim_sd}
    alone = not torch.distributed.is_initialized()  # one process (no process group): said to DCP, which warns anyway
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=alone)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


# ----------------------------------------------------------------------------------------------
# Writing.


def _failed_save(e, tmp):
    """A DCP CheckpointException (raised on every rank) as one RunDirError line."""
    errors = [exc for exc, _ in getattr(e, "failures", {}).values()]
    os_errors = [exc for exc in errors if isinstance(exc, OSError)]
    if os_errors:
        return RunDirError(os_error_message(os_errors[0], tmp))
    return RunDirError(f"cannot write {tmp}: {errors[0] if errors else e}")


def save_sharded(run_dir, model, optimizer, state, dist):
    """Write the sharded checkpoint of `model`, `optimizer` and the run `state` (STATE_KEYS) into
    run_dir/ckpt, every rank its own shards, atomically (see the module's doc); a collective. Removes a
    ckpt.pt it supersedes. Returns the checkpoint's path. A failed write on any rank is a RunDirError on
    every rank, the previous checkpoint kept."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict

    run_dir = Path(run_dir)
    tmp, final, old = run_dir / TMP, run_dir / NAME, run_dir / OLD

    def fresh():  # rank 0: an empty .ckpt.tmp (a killed save leaves one)
        with writing(tmp, RunDirError):
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
    agreed(dist, lambda: fresh() if dist.master else None)

    def visible():
        if not tmp.is_dir():
            raise RunDirError(f"rank {dist.rank} cannot see {tmp}: under FSDP every rank writes its shards into the "
                              "run directory, so out_dir must be on storage that every node shares")
    agreed(dist, visible)
    model_sd, optim_sd = get_state_dict(model, optimizer)  # DTensors: this rank's shards, nothing gathered
    try:
        dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True))
    except CheckpointException as e:
        raise _failed_save(e, tmp) from None

    def hash_mine():  # the files this rank wrote (DCP names them __<rank>_<n>.distcp)
        with writing(tmp, RunDirError):
            return {n: _digest(tmp / n) for n in os.listdir(tmp) if n.startswith(f"__{dist.rank}_")}
    digests = agreed(dist, hash_mine)
    if dist.world_size > 1:
        gathered = [None] * dist.world_size
        torch.distributed.all_gather_object(gathered, digests, group=dist.objects)
        digests = {k: v for d in gathered for k, v in d.items()}

    def commit():  # rank 0: the run state, the manifest last, then the renames
        write_file(tmp / STATE, _saved(state), RunDirError)
        with writing(tmp, RunDirError):
            files = {n: digests.get(n) or _digest(tmp / n) for n in sorted(os.listdir(tmp))}  # .metadata, state.pt
        manifest = {"format": SHARDED_FORMAT, "step": state["step"], "world_size": dist.world_size, "files": files}
        write_file(tmp / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode(), RunDirError)
        with writing(final, RunDirError):
            sync_dir(tmp)
            if final.is_dir():  # else .ckpt.old, if any, is the last checkpoint: kept until the new one is in place
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
            os.replace(tmp, final)
            sync_dir(run_dir)
            shutil.rmtree(old, ignore_errors=True)
            (run_dir / "ckpt.pt").unlink(missing_ok=True)  # an older single file (a run resumed under FSDP)
    agreed(dist, lambda: commit() if dist.master else None)
    return final


def _saved(state):
    import io

    buf = io.BytesIO()
    torch.save({k: state[k] for k in STATE_KEYS}, buf)
    return buf.getvalue()


def remove_sharded(run_dir):
    """Remove the run directory's sharded checkpoint and any half-written one (a run replacing it, or a
    single-file checkpoint superseding it)."""
    for name in (TMP, NAME, OLD):
        with writing(Path(run_dir) / name, RunDirError):
            shutil.rmtree(Path(run_dir) / name, ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# One file.


def whole_checkpoint(path):
    """The single-file checkpoint dict (checkpoint.CKPT_KEYS but its checksum, which save_checkpoint adds)
    of a sharded checkpoint: its shards gathered in this process, the weights a model's state_dict, the
    optimizer state an AdamW's state_dict over model.param_groups, as one process saves them."""
    state = read_sharded(path)
    with torch.device("meta"):
        model = GPT(GPTConfig(**state["model_config"]))
    model.to_empty(device="cpu")
    model.init_buffers()
    optimizer = torch.optim.AdamW(model.param_groups(state["train_config"]["weight_decay"]))  # its hyperparameters
    load_sharded(state["sharded"], model, optimizer)                                        # come from the checkpoint
    return {**{k: state[k] for k in STATE_KEYS}, "format": CKPT_FORMAT, "model": model.state_dict(),
            "optimizer": optimizer.state_dict()}


def export(path, out=None):
    """Write the sharded checkpoint that `path` (a run directory or the checkpoint's directory) names as one
    checksummed file, `out` or the run directory's ckpt.pt (then under the run's lock: not while it runs).
    Returns (out, step)."""
    kind, found = locate(path, prefer_sharded=True)
    if kind != "sharded":
        raise CheckpointError(f"{path} holds no sharded checkpoint" + (f" ({found} is one file already)"
                                                                     if found.exists() else ""))
    run_dir = found.parent
    out = Path(out) if out is not None else run_dir / "ckpt.pt"
    lock = DirLock(run_dir, "run", RunDirError) if out.resolve().parent == run_dir.resolve() else None
    try:
        ckpt = whole_checkpoint(found)
        save_checkpoint(out, ckpt)
    finally:
        if lock is not None:
            lock.release()
    return out, ckpt["step"]
