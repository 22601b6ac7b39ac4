"""
Files that are never half-written, and directories that one process at a time writes into.

Every file the project writes whole goes through write_atomic (a temporary file of this process alone,
fsync, rename over the path, fsync of the directory): a crash, a kill, a full disk or a second writer
leaves the old file or a new one, never part of one; a plot too (write_figure, with pyplot(): matplotlib
when it is installed, for the tools and the experiments alike). A directory is held through an exclusive flock on
its .lock file (lock_dir), which the OS lets go however the process ends; a lock file is never opened
through a symbolic link (O_NOFOLLOW), so a link planted at a lock's path is refused, never followed to
truncate and write a file elsewhere.
"""

import errno
import fcntl
import os
import secrets
import socket
import sys
from contextlib import contextmanager, suppress
from pathlib import Path

from depthres import os_error_message


@contextmanager
def writing(path, error):
    """An OSError while writing `path` becomes `error` with one line (os_error_message); error None: the
    OSError itself goes on."""
    try:
        yield
    except OSError as e:
        if error is None:
            raise
        raise error(os_error_message(e, path)) from None


def temporary(path):
    """Where write_atomic writes `path` before renaming it: a hidden name beside it, of this process and
    this call alone (.NAME.PID-RANDOM.tmp), so two processes writing the same file never share one."""
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def write_atomic(path, write, error=None):
    """Write a file atomically and durably: write(f) on a temporary file in the same directory
    (temporary(); f opened "wb"), fsync, rename over `path`, fsync the directory. On any failure,
    an exception from write(f) too, the temporary file is removed and `path` is as it was; an OSError
    becomes `error` (see writing)."""
    path = Path(path)
    tmp = temporary(path)
    with writing(path, error):
        try:
            with open(tmp, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise
        sync_dir(path.parent)


def write_file(path, data, error=None):
    """write_atomic of bytes, or of text (as UTF-8)."""
    data = data.encode() if isinstance(data, str) else data
    write_atomic(path, lambda f: f.write(data), error)


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display), or None with a note when matplotlib is not
    installed: plots are extras, and the tables and files that need no plot still go out."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        print("matplotlib is not installed: skipping plots (pip install matplotlib)", file=sys.stderr)
        return None


def write_figure(path, fig):
    """write_atomic of a matplotlib figure as a PNG (fig.savefig); the figure is closed either way."""
    import matplotlib.pyplot as plt

    try:
        write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=120))
    finally:
        plt.close(fig)


def check_writable(directory):
    """That `directory` takes a file, before the work whose result goes there: a temporary file of
    this process is made and removed (an OSError if not)."""
    probe = temporary(Path(directory) / ".probe")
    with open(probe, "xb"):
        pass
    probe.unlink()


def sync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_lock(path):
    """`path` opened for flock, made (0644) if missing, never through a symbolic link (an OSError, ELOOP).
    An entry this process cannot open for writing (a directory, a read-only file) is opened read-only:
    flock needs only an open file."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise
        try:
            return os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            raise e from None


class Lock:
    """An exclusive flock on an open file, held until release() or this process' end (the OS releases it
    however the process ends)."""

    def __init__(self, fd):
        self.fd = fd

    def release(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def try_lock(path):
    """A Lock on `path` (open_lock), with this process' pid and host written in it where it can be; None
    while a live process holds it. An OSError if `path` cannot be opened."""
    fd = open_lock(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    with suppress(OSError):  # the pid is for messages only: a full disk or a directory must not stop the lock
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    return Lock(fd)


def holder(path):
    """(pid, host) as strings of the process that holds a flock on `path` ("unknown" where it wrote
    none), or None when no live process does (or there is no such file)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return None  # nobody holds it (closing the file lets go at once)
    except BlockingIOError:
        who = os.pread(fd, 256, 0).decode(errors="replace").split()
        return (who[0] if who else "unknown", who[1] if len(who) > 1 else "unknown")
    finally:
        os.close(fd)


def lock_dir(directory, owner, error=RuntimeError, name=".lock"):
    """A Lock on `directory` (which must exist) for this process' life, through its file `name`, or
    `error` naming the process that holds it; `owner` says what holds such locks ("run",
    "prepare_data.py run")."""
    path = Path(directory) / name
    try:
        lock = try_lock(path)
    except OSError as e:
        raise error(os_error_message(e, path)) from None
    if lock is None:
        pid, host = holder(path) or ("unknown", "unknown")
        where = f" on {host}" if host not in ("unknown", socket.gethostname()) else ""
        raise error(f"{directory} is in use by another {owner} (pid {pid}{where})")
    return lock
