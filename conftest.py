"""Fixtures the tests share: one thread per test process, the tiny byte corpus, one uninterrupted run,
a read-only mount and a full disk;
and the order in which `make test-all` (pytest -n auto --dist loadgroup) hands the tests to its processes."""

import builtins
import errno
import gzip
import io
import json
import os
from pathlib import Path

import pytest
import torch

from prepare_data import DEFAULT_CORPUS, prepare

from runs import run


@pytest.fixture(autouse=True)
def one_thread():
    """The test model is tiny: a second thread only adds synchronisation (and contention on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """40 short documents of the embedded corpus as byte tokens (2 of them val, 2 test)."""
    tmp = tmp_path_factory.mktemp("data")
    with gzip.open(DEFAULT_CORPUS, "rt") as f:
        texts = [json.loads(line)["text"][:3000] for line in f][:40]
    source = tmp / "tiny.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prepare(data_files=[str(source)], tokenizer="byte", out_dir=tmp / "byte")
    return tmp / "byte"


@pytest.fixture(scope="session")
def straight(data_dir, tmp_path_factory):
    """An uninterrupted run of configs/test.py: 6 steps, checkpoints at 3 and 6, shared by the test
    files: tests read it (and see resumes of it refused), never change it."""
    out = tmp_path_factory.mktemp("straight")
    run(data_dir, out, "--run_name=straight")
    return out / "straight"


@pytest.fixture
def read_only(monkeypatch):
    """Make writes under the returned function's directories fail as on a read-only mount (EROFS):
    os.open for writing, os.mkdir, open() and Path.open in a writing mode. (As root, chmod stops nothing.)"""
    import builtins
    import errno
    import io
    roots = []

    def blocked(path, writing):
        return writing and any(str(Path(path)).startswith(str(r)) for r in roots)

    def refuse(path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    real_os_open, real_mkdir, real_open = os.open, os.mkdir, builtins.open

    def os_open(path, flags, *args, **kwargs):
        if blocked(path, flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)):
            refuse(path)
        return real_os_open(path, flags, *args, **kwargs)

    def mkdir(path, *args, **kwargs):
        if blocked(path, True) and Path(path).parent.is_dir() and not Path(path).exists():
            refuse(path)  # (with no parent: FileNotFoundError, as the kernel says first)
        return real_mkdir(path, *args, **kwargs)

    def open_(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, Path)) and blocked(file, any(c in mode for c in "wax+")):
            refuse(file)
        return real_open(file, mode, *args, **kwargs)
    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(io, "open", open_)
    return roots.append


@pytest.fixture
def full_disk(monkeypatch):
    """full_disk(directory, free): files opened for writing under `directory` (open(), Path.open) share
    `free` bytes, as on a disk with that much room: a write takes what is left, then fails with ENOSPC
    (a partial write, as the kernel gives, then the error)."""
    roots, room = [], {}
    real_open = builtins.open

    class Filling:
        def __init__(self, f):
            self._f = f

        def write(self, data):
            n = min(len(data), room["free"])
            if n:
                self._f.write(data[:n])
                room["free"] -= n
            if n < len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return n

        def writelines(self, lines):
            for line in lines:
                self.write(line)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

        def __getattr__(self, name):
            return getattr(self._f, name)

    def open_(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        writing = isinstance(file, (str, Path)) and any(c in mode for c in "wax+")
        return Filling(f) if writing and any(str(Path(file)).startswith(str(r)) for r in roots) else f
    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(io, "open", open_)

    def fill(directory, free):
        roots.append(directory)
        room["free"] = free
    return fill


def pytest_collection_modifyitems(config, items):
    """With --dist loadgroup (make test-all), each test process takes the next test when it is nearly
    idle (an xdist_group as one unit), in this order: the tests marked slow first, so that the last
    minutes are short tests on both cores, not one long test on one core while the other idles.
    Otherwise the tests keep their files' order."""
    if getattr(config.option, "loadgroup", False):  # set in xdist's test processes
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: files' order within


@pytest.fixture(scope="session")
def byte_data(tmp_path_factory):
    from prepare_data import main as prepare
    out = tmp_path_factory.mktemp("data") / "bytes"
    src = tmp_path_factory.mktemp("src") / "docs.jsonl"
    text = "To be, or not to be, that is the question. " * 40
    src.write_text("\n".join(json.dumps({"text": f"{i}: {text}"}) for i in range(30)))
    assert prepare(["--data_files", str(src), "--tokenizer", "byte", "--out_dir", str(out),
                    "--val_fraction", "0.2", "--test_fraction", "0.1"]) == 0
    return out
