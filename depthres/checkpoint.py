"""
The run directory and its checkpoints.

    out_dir/run_name/   config.json, log.jsonl, ckpt.pt or ckpt/, summary.json, wandb_id.txt (RUN_FILES), .lock
    ckpt.pt             one dict (CKPT_KEYS): weights, optimizer, loader and RNG states, configs, and a
                        sha256 of it all; written atomically, verified on every load
    ckpt/               an FSDP run's sharded checkpoint instead (below): no rank holds the whole state
    claim_run_dir       a run's claim on its directory: the lock for its life, the checkpoint it
                        continues, what it keeps of the log; a fresh run never replaces a run unasked

A sharded checkpoint is a directory:

    .metadata        torch.distributed.checkpoint's (DCP) index, written by rank 0
    __R_0.distcp     rank R's shards of the weights and the AdamW state, written by rank R
    state.pt         the rest of the run state (STATE_KEYS), written by rank 0
    manifest.json    written last: format, step, world size, torch version, every other file's bytes and
                     sha256 (each rank hashes the files it wrote)

save_sharded writes it into run_dir/.ckpt.tmp/, then renames the previous ckpt/ to .ckpt.old/, the new
one to ckpt/, and removes .ckpt.old/: at every instant ckpt/ or .ckpt.old/ is a whole checkpoint (a
reader takes .ckpt.old/ when ckpt/ is missing), so a kill during a save keeps the previous one.
load_sharded checks every file against the manifest (the ranks share the reading) and loads with DCP,
which reshards: the checkpoint of N ranks loads on M ranks, on one process (no FSDP) and under DDP.
Nothing in it is unpickled unsafely (read_index, _safe_dcp): the manifest's checksums guard against
damage, not against someone who can rewrite the files, so a tampered .metadata or shard is refused,
never executed. whole_checkpoint gathers it in one process, in ckpt.pt's format (export writes that file).
"""

import hashlib
import io
import json
import os
import pickle
import random
import resource
import shutil
import sys
import warnings
from contextlib import suppress
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch

from depthres import UserError, os_error_message
from depthres.config import model_config, total_steps
from depthres.distributed import Dist, agreed, per_rank
from depthres.files import Lock, lock_dir, sync_dir, write_atomic, write_file, writing
from model import GPTConfig
from model_fast import make_model

CKPT_FORMAT = "depthres-ckpt-2"
CKPT_KEYS = ("format", "model_config", "model", "tokenizer", "step", "train_config", "optimizer", "loader", "rng",
             "checksum")
CKPT_OPTIONAL = ("world_size",)  # keys added since: a checkpoint without them is read as before
CKPT_TYPES = {"model_config": dict, "model": dict, "tokenizer": str, "step": int, "train_config": dict,
              "optimizer": dict, "loader": dict, "rng": dict}  # what each key holds
# the advice of every refusal of a checkpoint (one damaged, or one not train.py's)
INTACT = "use an intact copy or another checkpoint"
ALTERED = f"it was not written by train.py, or was altered after; {INTACT}"
RUN_FILES = ("config.json", "log.jsonl", "ckpt.pt", "ckpt", "summary.json", "wandb_id.txt")  # what a run directory holds
# model keys that change how the model computes, not what: a run may resume with other values. What
# a change does to the numbers (tests/test_runlog.py): checkpointing recomputes the same operations,
# the other two order the same sums differently
EXECUTION_KEYS = {"depth_impl": "execution only: equal to float rounding",
                  "depth_chunk": "execution only: equal to float rounding",
                  "activation_checkpointing": "execution only: bit for bit"}
# training keys that are the run's identity: a resume cannot change them
IDENTITY_KEYS = {"seed": "the initial weights", "data_seed": "the order of the batches",
                 "batch_tokens": "the tokens of a step: a run's tokens are its steps x batch_tokens, as its summary "
                                 "and the tools count them"}


def rng_state(device):
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (name, keys.tolist(), pos, has_gauss, gauss),
             "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state, device):
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def on_cpu(x):
    """A checkpoint-like tree of dicts, lists and tuples with every tensor on the CPU."""
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, dict):
        return {k: on_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(on_cpu(v) for v in x)
    return x


def checksum(state):
    """sha256 over a checkpoint's contents but "checksum": every tensor's dtype, shape and bytes and
    every other value's type and repr, in order. Tensors must be on the CPU."""
    h = hashlib.sha256()

    def walk(x):
        if isinstance(x, torch.Tensor):
            t = x.contiguous().reshape(-1)
            h.update(f"<tensor {t.dtype} {tuple(x.shape)}>".encode())
            h.update(t.view(torch.uint8).numpy())
        elif isinstance(x, dict):
            h.update(f"<dict {len(x)}>".encode())
            for k, v in x.items():
                walk(k)
                walk(v)
        elif isinstance(x, (list, tuple)):
            h.update(f"<{type(x).__name__} {len(x)}>".encode())
            for v in x:
                walk(v)
        else:
            h.update(f"<{type(x).__name__} {x!r}>".encode())

    walk({k: v for k, v in state.items() if k != "checksum"})
    return h.hexdigest()


def save_checkpoint(path, state):
    """Write ckpt.pt atomically and durably (files.write_atomic): a kill or a full disk at any point leaves
    the previous checkpoint intact.

    The state is a dict with the keys CKPT_KEYS: "format" (CKPT_FORMAT), "model_config" (asdict of
    the GPTConfig), "model" (state_dict without wrapper prefixes), "tokenizer" (its name, for
    token_data.get_tokenizer), "step" (optimizer steps done), "train_config" (asdict of the
    TrainConfig), "optimizer", "loader" (TokenLoader.state_dict), "rng" (python, numpy, torch,
    cuda) and "checksum" (see checksum(); added here, verified by load_checkpoint); and since, the
    CKPT_OPTIONAL keys: "world_size" (the ranks that wrote it). It holds only tensors and plain Python
    values, so torch.load(weights_only=True) reads it.
    """
    state = on_cpu({k: v for k, v in state.items() if k != "checksum"})
    state["checksum"] = checksum(state)
    write_atomic(path, lambda f: _save(state, f), UserError)


def _save(obj, f):
    """torch.save into the file f, an OSError of its write raised as itself (torch reports it as a
    RuntimeError, so the writes are watched)."""
    failed = []

    class Watched:
        def write(self, data):
            try:
                return f.write(data)
            except OSError as e:
                failed.append(e)
                raise

        def flush(self):
            f.flush()

    try:
        torch.save(obj, Watched())
    except RuntimeError:
        if failed:
            raise failed[0] from None
        raise


# --- what a run directory holds: ckpt.pt, or an FSDP run's sharded ckpt/ ---

SHARDED_FORMAT = "depthres-sharded-1"
NAME, TMP, OLD = "ckpt", ".ckpt.tmp", ".ckpt.old"  # the sharded checkpoint's names in the run directory
GONE = ".ckpt.gone"  # a sharded checkpoint being deleted (remove_sharded): never read
MANIFEST, STATE, INDEX = "manifest.json", "state.pt", ".metadata"  # INDEX: DCP's, a pickle
STATE_KEYS = tuple(k for k in CKPT_KEYS if k not in ("model", "optimizer", "checksum"))  # state.pt's


def committed(run_dir):
    """The run directory's sharded checkpoint: ckpt/, or .ckpt.old/ between a save's two renames; or None."""
    return next((Path(run_dir) / name for name in (NAME, OLD) if (Path(run_dir) / name).is_dir()), None)


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
    try:  # mapped: only the step is read
        f = int(torch.load(file, map_location="cpu", weights_only=True, mmap=True)["step"])
    except Exception:
        raise UserError(f"{file} is not a readable checkpoint: it is truncated, corrupt or not a checkpoint; "
                        f"{INTACT}") from None
    s = read_manifest(sharded)["step"]
    return ("sharded", sharded) if s > f or (s == f and prefer_sharded) else ("file", file)


def read_manifest(path):
    """The manifest of the sharded checkpoint at `path`, checked: its format, its step and world size (whole
    numbers), and its files (at least the index and the run state: each a plain name, its bytes and its sha256)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        manifest = None
    why = _manifest_problem(manifest)
    if why is not None:
        raise UserError(f"{path} is not a whole sharded checkpoint: its {MANIFEST} {why}; {INTACT}")
    return manifest


def _manifest_problem(manifest):
    """What read_manifest finds wrong with a manifest, as a phrase; or None."""
    def whole(x, low):
        return isinstance(x, int) and not isinstance(x, bool) and x >= low

    if manifest is None:
        return "is missing or not JSON"
    if not isinstance(manifest, dict) or manifest.get("format") != SHARDED_FORMAT:
        return f"is not of format {SHARDED_FORMAT!r}"
    for name, low in (("step", 0), ("world_size", 1)):
        if not whole(manifest.get(name), low):
            return f"has no {name} (a whole number >= {low}), got {manifest.get(name)!r}"
    files = manifest.get("files")
    if not isinstance(files, dict) or not {INDEX, STATE} <= set(files):
        return f"does not list the files it holds ({INDEX} and {STATE} at least), got {files!r:.80}"
    for name, entry in files.items():
        if Path(name).name != name or name in (".", "..") or not isinstance(entry, dict) \
                or not whole(entry.get("bytes"), 0) or not isinstance(entry.get("sha256"), str):
            return f"lists {name!r} as {entry!r:.80}, not a file name with its bytes and sha256"
    return None


def file_digest(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return {"bytes": os.path.getsize(path), "sha256": h.hexdigest()}


def verify_files(path, names, files):
    """Each of `names` has the bytes and sha256 the manifest gives it."""
    for name in names:
        try:
            ok = file_digest(path / name) == files[name]
        except OSError:
            ok = False
        if not ok:
            raise UserError(f"{path / name} is missing or corrupt: its contents do not match the checksum in "
                            f"{path / MANIFEST} (damaged on disk or in a copy); {INTACT}")


# What DCP's index (.metadata, a pickle of a Metadata) may name: its dataclasses, torch.Size, dtypes, the
# layout and memory-format encodings of TensorProperties, and the path it was saved to. Nothing else is
# ever looked up, so unpickling it calls no other code (DCP's own reader uses plain pickle.load).
INDEX_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata",
                                              "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                                              "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout from its name
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"}, "pathlib._local": {"PosixPath", "PurePosixPath"},
}


class _Foreign(pickle.UnpicklingError):
    """A name that INDEX_CLASSES does not admit: (module, name)."""


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if name in INDEX_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Foreign(module, name)


def read_index(path):
    """The DCP index (a Metadata) of the sharded checkpoint at `path`, unpickled by a loader that admits only
    INDEX_CLASSES: a file that names anything else (code to run) is refused, never executed."""
    import torch.distributed.checkpoint.filesystem  # noqa: F401 (the modules INDEX_CLASSES names)
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        index = _IndexUnpickler(io.BytesIO((path / INDEX).read_bytes())).load()
        why = None if isinstance(index, Metadata) else f"it holds a {type(index).__name__}, not a Metadata"
    except _Foreign as e:
        module, name = e.args
        why = f"it names {module}.{name}, which an index never holds"
        if module.split(".")[0] == "torch":  # perhaps a torch whose DCP writes more than this reader admits
            wrote = read_manifest(path).get("torch")  # whose DCP wrote the index (older manifests: none)
            if wrote != torch.__version__:
                raise UserError(
                    f"{path / INDEX} names {module}.{name}, which this reader does not admit under torch "
                    f"{torch.__version__}; the checkpoint was written by torch {wrote or '(not recorded)'}, whose DCP "
                    "may hold it: read the checkpoint with that torch (requirements.txt states the tested range), "
                    "or admit the name in depthres.checkpoint.INDEX_CLASSES once it is known to be plain data") from None
    except Exception as e:  # not a pickle, or a cut one: nothing outside INDEX_CLASSES was called
        why = f"{type(e).__name__} reading it"
    if why is not None:
        raise UserError(f"{path / INDEX} is not the index of a sharded checkpoint ({why}): {ALTERED}")
    return index


def read_sharded(path):
    """The run state of a sharded checkpoint (STATE_KEYS and its world_size), with "sharded": its directory.
    Checks the manifest, that every file it lists is there at its size, and state.pt's checksum; the shards'
    checksums are checked by load_sharded."""
    path = Path(path)
    manifest = read_manifest(path)
    files = manifest["files"]
    short = [n for n, f in files.items() if not (path / n).is_file() or os.path.getsize(path / n) != f["bytes"]]
    if short:
        raise UserError(f"{path} is incomplete: {', '.join(sorted(short))} missing or of the wrong size; {INTACT}")
    verify_files(path, [STATE], files)
    index = read_index(path)  # refused here, before a run starts, if it is not plain data
    named = sorted({getattr(s, "relative_path", None) for s in (index.storage_data or {}).values()} - set(files),
                   key=str)  # a file outside the checkpoint, or one no checksum covers, is never read
    if named:
        raise UserError(f"{path / INDEX} names {named[0]!r} as a file of the checkpoint, which its {MANIFEST} "
                        f"does not list: {ALTERED}")
    try:
        state = torch.load(path / STATE, map_location="cpu", weights_only=True)
    except Exception as e:  # torch's own message may advise weights_only=False, which is unsafe: not quoted
        state = f"{type(e).__name__} reading it"
    if not isinstance(state, dict) or state.get("format") != CKPT_FORMAT or any(k not in state for k in STATE_KEYS):
        why = state if isinstance(state, str) else f"a {type(state).__name__} without the keys of format {CKPT_FORMAT!r}"
        raise UserError(f"{path / STATE} is not a run state ({why}): {ALTERED}")
    check_contents(state, path / STATE)
    return {**state, "world_size": manifest["world_size"], "sharded": path}  # the ranks that wrote it


def check_contents(state, path):
    """Each CKPT_TYPES key of a checkpoint (or a sharded one's run state) holds what it should, its step a whole
    number >= 0: a checksum recomputed over other contents is one line, not a traceback (or negative lrs)."""
    wrong = next((f"its {k} is a {type(state[k]).__name__}, not a {t.__name__}" for k, t in CKPT_TYPES.items()
                  if k in state and (not isinstance(state[k], t) or isinstance(state[k], bool))), None)
    if wrong is None and state["step"] < 0:
        wrong = f"its step is {state['step']}, not a whole number >= 0"
    if wrong is not None:
        raise UserError(f"{path} is not a run's checkpoint ({wrong}): {ALTERED}")


def load_checkpoint(path_or_run_dir, sharded=False):
    """The checkpoint dict (on the CPU) of a run directory (its ckpt.pt) or a checkpoint file, format and
    checksum checked. A sharded checkpoint (an FSDP run's ckpt/, or a run directory whose newest checkpoint it
    is): with sharded=True its run state (read_sharded), from which each rank loads its part of the weights and
    optimizer (load_sharded); otherwise refused, naming the export command."""
    kind, path = locate(path_or_run_dir, prefer_sharded=sharded)
    if kind == "sharded":
        if not sharded:
            named = Path(path_or_run_dir)
            run_dir = named.parent if named.name in (NAME, OLD) else named
            raise UserError(f"{named} holds a sharded checkpoint (an FSDP run's {NAME}/): write it as one file "
                            f"with `python -m tools.export_ckpt {run_dir}`, then use {run_dir / 'ckpt.pt'}")
        return read_sharded(path)
    if not path.is_file():
        raise UserError(f"no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch's own message may advise weights_only=False, which is unsafe: not quoted
        raise UserError(f"{path} is not a readable checkpoint ({type(e).__name__} reading it): it is truncated, "
                        f"corrupt or not a checkpoint; {INTACT}") from None
    if not isinstance(ckpt, dict) or "format" not in ckpt:
        raise UserError(f"{path} is not a train.py checkpoint (no format tag)")
    if ckpt["format"] != CKPT_FORMAT:
        older = " (an older train.py's, without a checksum)" if ckpt["format"] == "depthres-ckpt-1" else ""
        raise UserError(f"{path} has format {ckpt['format']!r}{older}; this train.py reads {CKPT_FORMAT!r}")
    missing = [k for k in CKPT_KEYS if k not in ckpt]
    if missing:
        raise UserError(f"{path} lacks {', '.join(missing)}: it is incomplete")
    if checksum(ckpt) != ckpt["checksum"]:
        raise UserError(f"{path} is corrupt: its contents do not match the checksum written with it "
                        f"(damaged on disk or in a copy); {INTACT}")
    check_contents(ckpt, path)
    ckpt["model"] = {renamed(k): v for k, v in ckpt["model"].items()}  # written under older names: today's
    return ckpt


# Parameter names that changed, old prefix -> new: checkpoints written before still load.
RENAMED = {"router.": "residual."}  # the residual module was GPT.router


def renamed(key):
    for old, new in RENAMED.items():
        if key.startswith(old):
            return new + key.removeprefix(old)
    return key


def load_model(path_or_run_dir, device="cpu", ckpt=None):
    """(the model of a checkpoint file or run directory, in eval mode on `device`; the checkpoint dict; ckpt:
    that dict, already read, e.g. a sharded checkpoint gathered by whole_checkpoint). No readable
    checkpoint, or a model this model.py cannot build or load, is one UserError line."""
    ckpt = load_checkpoint(path_or_run_dir) if ckpt is None else ckpt
    try:
        mc = model_config(ckpt["model_config"])
        weights, wte = ckpt["model"], ckpt["model"].get("wte.weight")
        layers = len({k.split(".")[1] for k in weights if k.startswith("blocks.")})
        if layers != mc.n_layer or wte is None or tuple(wte.shape) != (mc.vocab_size, mc.n_embd):  # before a model
            raise ValueError(f"its config declares n_layer={mc.n_layer}, vocab_size={mc.vocab_size}, n_embd={mc.n_embd}; "
                             f"its weights hold {layers} layers and an embedding of shape "
                             f"{tuple(wte.shape) if wte is not None else None}")  # of that size is built
        model = make_model(mc)
        model.load_state_dict(weights)
    except (TypeError, ValueError, RuntimeError) as e:  # torch's load_state_dict: a line per mismatch, the first said
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
        first = " ".join(lines[:2]) + (f" (and {len(lines) - 2} more)" if len(lines) > 2 else "")
        raise UserError(f"{path_or_run_dir}: the checkpoint's model does not fit this model.py: {first}") from None
    return model.to(device).eval(), ckpt


# --- the sharded checkpoint: writing and removing (on every rank: collectives) ---


def save_sharded(run_dir, model, optimizer, state, dist):
    """Write the sharded checkpoint of `model`, `optimizer` and the run `state` (STATE_KEYS) into
    run_dir/ckpt, every rank its own shards, by the two renames of the module's doc; a collective. Removes
    a ckpt.pt it supersedes. A failed write on any rank is a UserError on every rank, the previous
    checkpoint kept and the partial new one removed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict

    run_dir = Path(run_dir)
    tmp = run_dir / TMP

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

    def hash_mine():  # the files this rank wrote (DCP names them __<rank>_<n>.distcp)
        with writing(tmp, UserError):
            return {n: file_digest(tmp / n) for n in os.listdir(tmp) if n.startswith(f"__{dist.rank}_")}

    def run_state(digests):  # rank 0: the run state, the manifest last
        write_atomic(tmp / STATE, lambda f: _save({k: state[k] for k in STATE_KEYS}, f), UserError)
        with writing(tmp, UserError):
            files = {n: digests.get(n) or file_digest(tmp / n) for n in sorted(os.listdir(tmp))}  # .metadata, state.pt
        manifest = {"format": SHARDED_FORMAT, "step": state["step"], "world_size": dist.world_size,
                    "torch": torch.__version__, "files": files}  # torch: whose DCP wrote the index
        write_file(tmp / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode(), UserError)

    try:
        model_sd, optim_sd = get_state_dict(model, optimizer)  # DTensors: this rank's shards, nothing gathered
        try:
            dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True))
        except CheckpointException as e:
            raise _failed_save(e, tmp) from None
        digests = {k: v for mine in per_rank(dist, agreed(dist, hash_mine)) for k, v in mine.items()}
        agreed(dist, lambda: run_state(digests) if dist.master else None)
    except UserError:  # on every rank: rank 0 removes the partial shards (a full disk is left as it was)
        if dist.master:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    agreed(dist, lambda: _commit(run_dir) if dist.master else None)


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


def _failed_save(e, tmp):
    """A DCP CheckpointException (raised on every rank) as one UserError line. torch reports a failed write
    of a shard as a RuntimeError ("[enforce fail at inline_container.cc...] file write failed"), without its
    errno: the cause is found from the file system and the file-size limit instead."""
    errors = [exc for exc, _ in getattr(e, "failures", {}).values()]
    os_errors = [exc for exc in errors if isinstance(exc, OSError)]
    if os_errors:
        return UserError(os_error_message(os_errors[0], tmp))
    with suppress(OSError):
        disk = os.statvfs(tmp.parent)
        if disk.f_bavail * disk.f_frsize < 1 << 20:
            return UserError(f"no space left on device writing {tmp}")
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        return UserError(f"cannot write {tmp}: a shard would pass this process' file-size limit of {limit:,} "
                         "bytes (ulimit -f); raise it, or give the run more ranks")
    return UserError(f"cannot write {tmp}: writing a shard failed ({type(errors[0]).__name__ if errors else e}): "
                     "a full disk, a quota or a failing device")


# --- the sharded checkpoint: loading (with any number of ranks), and as one file ---


def _safe_dcp(path, index):
    """(storage reader, load planner) for dcp.load that unpickle nothing unsafely: torch's own read the index
    (.metadata) with plain pickle.load and the shards' non-tensor values (the AdamW hyperparameters) with
    torch.load(weights_only=False), so a tampered checkpoint (its manifest recomputed) could run code. Here
    the index is read_index's and every value goes through torch.load(weights_only=True)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            index.storage_meta = index.storage_meta or StorageMeta()  # as FileSystemReader.read_metadata
            index.storage_meta.load_id = self.load_id
            return index

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            try:
                value = torch.load(value, weights_only=True)
            except Exception as e:  # torch's message advises weights_only=False, which is unsafe: not quoted
                raise UserError(f"{path} holds a value that is not plain data ({read_item.dest_index.fqn}: "
                                f"{type(e).__name__} reading it): {ALTERED}") from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], value)
            else:
                self.state_dict[read_item.dest_index.fqn] = value

    return Reader(path), Planner()


def load_sharded(path, model, optimizer, dist):
    """Load a sharded checkpoint's weights and AdamW state into `model` and `optimizer`, on every rank (a
    collective), sharded (FSDP2) or not, on any number of ranks: DCP reads each rank's part. Every file
    is checked against the manifest first, the ranks sharing the reading."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    files = read_manifest(path)["files"]
    mine = sorted(files)[dist.rank::dist.world_size]
    agreed(dist, lambda: verify_files(path, mine, files))
    model_sd, optim_sd = get_state_dict(model, optimizer)  # this rank's tensors, filled in place
    index = read_index(path)
    # a checkpoint written before RENAMED's renames: its names (its keys are "model." + a parameter's name)
    old = [(o, n) for o, n in RENAMED.items() if any(k.startswith("model." + o) for k in index.state_dict_metadata)]
    state = _names({"model": model_sd, "optim": optim_sd},
                   lambda name: next((o + name.removeprefix(n) for o, n in old if name.startswith(n)), name))
    alone = not torch.distributed.is_initialized()  # one process (no process group): said to DCP, which warns anyway
    reader, planner = _safe_dcp(path, index)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        try:
            dcp.load(state, storage_reader=reader, planner=planner, no_dist=alone)
        except CheckpointException as e:  # raised on every rank: the first rank's error, its first line
            errors = [exc for exc, _ in getattr(e, "failures", {}).values()]
            first = errors[0] if errors else e  # (e's text holds each rank's remote traceback)
            why = next((line.strip() for line in str(first).splitlines() if line.strip()), "")
            raise next((x for x in errors if isinstance(x, UserError)), UserError(
                f"{path} cannot be loaded into this model ({type(first).__name__}: {why}); {INTACT}")) from None
        state = _names(state, renamed)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _names(state, rename):
    """A (model, optimizer) state dict with every parameter name in it (dict keys, param_groups'
    "params") passed through rename; the tensors are the same objects."""
    if isinstance(state, dict):
        return {_names(k, rename): _names(v, rename) for k, v in state.items()}
    if isinstance(state, list):
        return [_names(v, rename) for v in state]
    return rename(state) if isinstance(state, str) else state


def whole_checkpoint(path):
    """The single-file checkpoint dict (CKPT_KEYS but its checksum, which save_checkpoint adds)
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
    load_sharded(state["sharded"], model, optimizer, Dist(0, 1, torch.device("cpu")))       # come from the checkpoint
    return {**{k: state[k] for k in STATE_KEYS}, "model": model.state_dict(),
            "optimizer": optimizer.state_dict(), "world_size": state["world_size"]}


def export(path, out=None, overwrite=False):
    """tools/export_ckpt.py: write the sharded checkpoint that `path` (a run directory or the checkpoint's
    directory) names as one checksummed file, `out` or the run directory's ckpt.pt, where that tool's doc
    says it may. Returns (out, step)."""
    kind, found = locate(path, prefer_sharded=True)
    if kind != "sharded":
        raise UserError(f"{path} holds no sharded checkpoint" + (f" ({found} is one file already)"
                                                                 if found.exists() else ""))
    run_dir = found.parent
    out = Path(out) if out is not None else run_dir / "ckpt.pt"
    target = out.resolve()
    for name in (NAME, OLD, TMP):
        if (run_dir / name).resolve() in (target, *target.parents):
            raise UserError(f"--out {out} is inside the checkpoint being exported ({run_dir / name}): writing "
                            f"it would destroy what it reads; write to {run_dir / 'ckpt.pt'} (the default) or "
                            "outside the run directory")
    if out.is_dir():
        raise UserError(f"--out {out} is a directory: give the path of the file to write")
    if target != (run_dir / "ckpt.pt").resolve() and not overwrite:
        if out.exists() or out.is_symlink():
            raise UserError(f"--out {out} exists: pass --overwrite to replace it, or choose another path")
        held = [name for name in RUN_FILES if (target.parent / name).exists()]
        if held and target.parent != run_dir.resolve():
            raise UserError(f"--out {out} is in another run's directory ({', '.join(held)}): that run's "
                            "--resume=true would continue from this export; pass --overwrite if it should, or "
                            "choose another path")
    into = target.parent
    lock = lock_dir(into, "run", UserError) if (into / ".lock").exists() or any(
        (into / name).exists() for name in RUN_FILES) else None  # a run directory: not while a run holds it
    try:
        ckpt = whole_checkpoint(found)
        save_checkpoint(out, ckpt)
    finally:
        if lock is not None:
            lock.release()
    return out, ckpt["step"]


# --- the run directory's claim ---


def resume_path(tc, run_dir):
    """Where to resume from: None (a fresh run), this run's directory, or the given path."""
    if tc.resume.lower() in ("", "false", "0"):
        return None
    return run_dir if tc.resume.lower() in ("true", "1") else Path(tc.resume)


def check_resumable(ckpt, path, mc, tokenizer, last_step=None, tc=None):
    """The checkpoint's model is this run's model (EXECUTION_KEYS may differ) on the same tokens, at a
    step this run reaches (last_step: the run's last step, None: not checked), with the same identity
    (IDENTITY_KEYS of tc, the run's TrainConfig; None: not checked)."""
    if ckpt["tokenizer"] != tokenizer:  # first: another vocabulary would also be another model
        raise UserError(f"checkpoint {path} was trained on {ckpt['tokenizer']!r} tokens, "
                        f"but data_dir holds {tokenizer!r} tokens")
    # a key an older checkpoint lacks had its default then (keys are only ever added with the old behaviour)
    have = {**{f.name: f.default for f in fields(GPTConfig)}, **ckpt["model_config"]}
    want = asdict(mc)
    differ = [k for k in sorted(set(have) | set(want))
              if k not in EXECUTION_KEYS and have.get(k, "(absent)") != want.get(k, "(absent)")]
    if differ:
        def detail(k):
            there, here = have.get(k, "(absent)"), want.get(k, "(absent)")
            old_len = ckpt["train_config"].get("seq_len")
            if k == "block_size" and tc is not None and (there, here) == (old_len, tc.seq_len):
                return f"seq_len: {there!r} there, {here!r} here (the model's block_size follows it)"
            return f"{k}: {there!r} there, {here!r} here"
        raise UserError(f"checkpoint {path} holds another model ({', '.join(map(detail, differ))}); resume "
                        f"with its config, or start a fresh run under another run_name")
    if tc is not None:
        changed = [k for k in IDENTITY_KEYS if ckpt["train_config"].get(k, getattr(tc, k)) != getattr(tc, k)]
        if changed:
            there = ", ".join(f"{k}={ckpt['train_config'][k]}" for k in changed)
            raise UserError(
                f"checkpoint {path} was trained with {there}; a resume cannot change "
                f"{' or '.join(f'{k} ({getattr(tc, k)} here: {IDENTITY_KEYS[k]})' for k in changed)}: resume with "
                f"{there}, or start a fresh run under another run_name")
    if last_step is not None and ckpt["step"] > last_step:
        raise UserError(f"checkpoint {path} is at step {ckpt['step']}, past this run's last step {last_step}: "
                        f"resume with max_steps >= {ckpt['step']} (or a larger max_tokens)")


def last_good(saved, good=True):
    """What is kept of the run: `saved` is (step, path) of its last checkpoint, or None."""
    if saved is None:
        return "no checkpoint was written"
    return f"the last {'good ' if good else ''}checkpoint (step {saved[0]}) is kept at {saved[1]}"


def read_log(path, last_step, finished=False):
    """The lines of a log.jsonl whose step is at most `last_step`: what a run resumed from a
    checkpoint at that step keeps (what a killed run logged after its checkpoint is redone). With
    `finished` (the checkpoint is the run's last step), the records of that step other than its
    train record go too: a resumed finished run redoes its final evaluations; so do the resume and
    start records at that step (the resume that reads this log writes its own). A line that is not a
    JSON record with a whole step and a kind (the torn last line of a kill or a full disk, or a foreign
    line) is dropped, with a note. So every (kind, split, step) is logged once, whatever kills and resumes
    came before."""
    if not path.exists():
        return []
    kept, torn = [], []
    with writing(path, UserError):
        lines = path.read_bytes().decode("utf-8", errors="replace").splitlines()
    for n, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
            step, kind = record["step"], record["kind"]
            if not isinstance(step, int) or isinstance(step, bool) or not isinstance(kind, str):
                raise TypeError
        except (ValueError, TypeError, KeyError, IndexError):
            if line.strip():
                torn.append(n)
            continue
        if step < last_step or (step == last_step and (kind == "train" or not finished)
                                and kind not in ("resume", "start")):
            kept.append(line)  # (the resume and start records at last_step are this resume's to write)
    if torn:
        print(f"note: {path}: dropped {len(torn)} unreadable line(s) ({', '.join(map(str, torn[:5]))}), "
              "as a kill or a full disk leaves them (or not train.py's records)", file=sys.stderr)
    return kept


def logged_compute(log):
    """Whether a log.jsonl holds a record of anything computed: a line that is not a "start" record
    (provenance, written before step 1; a torn line counts as computed)."""
    with writing(log, UserError):
        lines = log.read_bytes().splitlines() if log.exists() else []
    for line in filter(bytes.strip, lines):
        try:
            if json.loads(line).get("kind") != "start":
                return True
        except (ValueError, AttributeError):
            return True
    return False


@dataclass
class Claim:
    """What rank 0 holds of the run directory: its lock, the checkpoint to start from (or None),
    whether that is this directory's own run (resume=true), and the log lines that run keeps."""
    lock: Lock
    ckpt: dict | None
    continuing: bool
    kept_log: list


def claim_run_dir(tc, run_dir, mc, tokenizer):
    """Lock the run directory for this run's life and check what it holds against what this run
    would do with it; a Claim. Writes nothing in run_dir but its .lock."""
    source, last_step = resume_path(tc, run_dir), total_steps(tc)
    continuing = source is not None and source.resolve() in (run_dir.resolve(), (run_dir / "ckpt.pt").resolve(),
                                                             (run_dir / "ckpt").resolve())
    ckpt = None
    if source is not None and not continuing:  # a new run here, from another run's checkpoint
        ckpt = load_checkpoint(source, sharded=True)
        check_resumable(ckpt, source, mc, tokenizer, last_step, tc)
    with writing(run_dir, UserError):
        run_dir.mkdir(parents=True, exist_ok=True)
    lock = lock_dir(run_dir, "run", UserError)
    try:
        if source == run_dir and not holds_checkpoint(run_dir) and not (run_dir / "summary.json").exists():
            # resume=true, stopped (or never started) before its first checkpoint: nothing to continue, so
            # it starts afresh, and a requeue script may always pass --resume=true (a named file must exist)
            print(f"note: {run_dir} holds no checkpoint yet: starting the run from step 0", file=sys.stderr)
            return Claim(lock, None, False, [])
        if continuing:
            ckpt = load_checkpoint(source, sharded=True)
            check_resumable(ckpt, source, mc, tokenizer, last_step, tc)
            kept = read_log(run_dir / "log.jsonl", ckpt["step"], finished=ckpt["step"] == last_step)
            return Claim(lock, ckpt, True, kept)
        held = [name for name in RUN_FILES if (run_dir / name).exists()]
        if held and not tc.overwrite and set(held) <= {"config.json", "log.jsonl", "wandb_id.txt"} \
                and not logged_compute(run_dir / "log.jsonl"):
            # a start that failed before its first step (a compiler or W&B that would not start, a kill): only
            # what a run writes at its start, nothing it computed, so a plain rerun takes the directory over
            print(f"note: {run_dir} holds a run that never logged a step ({', '.join(held)}): starting it afresh",
                  file=sys.stderr)
            return Claim(lock, ckpt, False, [])
        if held and not tc.overwrite:
            ways = ("continue it with --resume=true, or start over with --overwrite=true"
                    if {"ckpt.pt", "ckpt"} & set(held) and source is None else
                    "replace it with --overwrite=true, or choose another run_name")
            raise UserError(f"{run_dir} already holds a run ({', '.join(held)}): {ways}")
        return Claim(lock, ckpt, False, [])
    except BaseException:
        lock.release()
        raise
