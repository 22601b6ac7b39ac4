"""What the commands share: errors and exit statuses, atomic writes, torchrun ranks, the run log."""

import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager, suppress
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent  # the repository, where train.py usually runs


class UserError(ValueError):
    """Bad input, or what the machine refused: one line that says what to do."""


class Stopped(KeyboardInterrupt):
    """Stopped by signal `signum`: exit 128 + signum."""

    def __init__(self, message, signum):
        super().__init__(message)
        self.signum = signum


def need(ok, message):
    if not ok:
        raise UserError(message)


def stop(signum, frame):
    raise Stopped(f"stopped by {signal.Signals(signum).name}", signum)


@contextmanager
def signal_handlers(handlers, over_ignored=False):
    """{signum: handler} for the block (main thread only); an ignored signal stays ignored unless over_ignored."""
    in_main = threading.current_thread() is threading.main_thread()  # the only thread that may set handlers
    previous = {s: signal.signal(s, h) for s, h in handlers.items()
                if in_main and (over_ignored or signal.getsignal(s) is not signal.SIG_IGN)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def cli(main, argv=None):
    """main(argv) as a command: 0, 2 after one `error:` line, 128 + signum after a stop (SIGINT or SIGTERM)."""
    try:
        with signal_handlers({signal.SIGINT: signal.default_int_handler, signal.SIGTERM: stop}):
            status = main(argv)
        return status if isinstance(status, int) else 0
    except BrokenPipeError:  # `| head` has what it wants: silence the flush at exit
        discard_stdout()
        return 0
    except (UserError, OSError) as e:  # bad input; a full disk, a path the OS refuses
        print(f"error: {error_line(e)}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt as e:
        if rank() == 0:
            print(str(e) or "interrupted", file=sys.stderr, flush=True)
        return 128 + getattr(e, "signum", 2)


def error_line(e):
    """The one line a UserError (its message) or an OSError (os_error_message) gets."""
    return str(e) if isinstance(e, UserError) else os_error_message(e)


def os_error_message(e, path=None, verb="write"):
    """One line for an OSError ("cannot write PATH: ...")."""
    where, reason = path or e.filename, str(e.strerror or e)
    reason = reason[:1].lower() + reason[1:]
    return f"cannot {verb} {where}: {reason}" if where else reason


def write_atomic(path, data):
    """Write `data` (bytes, str, or fn(file)) to `path` whole or not at all (temp, fsync, rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")  # this writer's alone
    try:
        with open(tmp, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise


def read_json(path):
    """A JSON object from a file, or None: not there, torn, or not an object."""
    try:
        x = json.loads(Path(path).read_bytes())
    except (OSError, ValueError):
        return None
    return x if isinstance(x, dict) else None


def log_records(run_dir):
    """The JSON records of a run's log.jsonl (a torn line skipped)."""
    path, records = Path(run_dir) / "log.jsonl", []
    for line in path.read_text(errors="replace").splitlines() if path.is_file() else []:
        with suppress(ValueError):
            records.append(json.loads(line))
    return [r for r in records if isinstance(r, dict)]


# The ranks of a torchrun job (one process without torchrun).
def rank():
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


def any_rank(value, device="cpu"):
    """The largest of the ranks' values, on every rank."""
    t = torch.full((), float(value), device=device)
    if world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def on_rank0(fn, shared=None):
    """fn() on rank 0: its result there, shared(result) (default: the result) on the other ranks, its error on all."""
    result = error = None
    if rank() == 0:
        try:
            result = fn()
        except (UserError, OSError) as e:
            error = error_line(e)
    if world_size() > 1:
        box = [((shared or (lambda r: r))(result) if rank() == 0 and error is None else None, error)]
        dist.broadcast_object_list(box, src=0)
        result, error = (result if rank() == 0 else box[0][0]), box[0][1]
    if error is not None:
        raise UserError(error)
    return result


def discard_stdout():
    """Standard output to /dev/null from here on: its reader (`| head`) has gone."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def say(text):
    """print(text), flushed; a closed pipe discards the rest of the output instead of stopping the work."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        discard_stdout()


def busy_cores(cores, seconds=0.25):
    """How many of `cores` (CPU numbers) other work keeps busy: /proc/stat over `seconds`, else the 1-minute load."""
    def sample():
        rows = [r.split() for r in Path("/proc/stat").read_text().splitlines() if r.startswith("cpu") and r[3].isdigit()]
        ticks = [list(map(int, r[1:])) for r in rows if int(r[0][3:]) in cores]
        return sum(map(sum, ticks)), sum(t[3] + t[4] for t in ticks)  # all, idle + iowait
    try:
        (t0, i0), _, (t1, i1) = sample(), time.sleep(seconds), sample()
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0] * len(cores) / (os.cpu_count() or 1)
    return len(cores) * (1 - (i1 - i0) / max(t1 - t0, 1))


def cpu_threads(ranks=1):
    """Intra-op threads: OMP_NUM_THREADS's, else the free cores this process may use, shared among `ranks` (>= 1)."""
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    return max(1, round(len(cores) - busy_cores(cores)) // ranks)


def perplexity(loss):
    return math.exp(loss) if loss < 709 else math.inf


def utc_now():
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def git_commit():
    """This checkout's commit, "+dirty" where a tracked file differs from it; None outside git."""
    try:
        head, status = (subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10)
                        for args in (["rev-parse", "HEAD"], ["status", "--porcelain", "--untracked-files=no"]))
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if status.stdout.strip() else "") if head.returncode == 0 else None


def provenance(before=None):
    """Where a run ran, over its segments: its first start (UTC), every segment's commit, torch and host."""
    seen = {k: set((before or {}).get(k) or []) for k in ("commits", "torch", "hosts")}
    for k, v in (("commits", git_commit()), ("torch", str(torch.__version__)), ("hosts", socket.gethostname())):
        seen[k] |= {v} if v else set()
    return {"started_utc": (before or {}).get("started_utc") or utc_now(), **{k: sorted(v) for k, v in seen.items()}}
