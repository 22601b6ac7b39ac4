"""Fixtures the tests share: one thread per test process, the tiny byte corpus, one uninterrupted run;
and the order in which `make test-all` (pytest -n auto --dist loadgroup) hands the tests to its processes."""

import gzip
import json

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


def pytest_collection_modifyitems(config, items):
    """With --dist loadgroup (make test-all), each test process takes the next test when it is nearly
    idle (an xdist_group as one unit), in this order: the tests marked slow first, so that the last
    minutes are short tests on both cores, not one long test on one core while the other idles.
    Otherwise the tests keep their files' order."""
    if getattr(config.option, "loadgroup", False):  # set in xdist's test processes
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: files' order within
