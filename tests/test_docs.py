"""Every command in the README and docs/ runs as written: each names a file, module, config, make
target and flag that exists. Commands are read from fenced code blocks and from inline code that
starts like a command (`python ...`, `make ...`, `torchrun ...`)."""

import dataclasses
import re
import shlex
from pathlib import Path

import pytest

from model import GPTConfig
from train import TrainConfig

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
STARTS = ("python", "python3", "torchrun", "make", ".venv/bin/python")


def commands(text):
    """The command lines of a page: fenced blocks (continuations joined, comments dropped) and
    inline code that starts like a command."""
    found, blocks, block, lang = [], [], None, None
    for line in text.splitlines():
        if line.startswith("```"):
            if block is None:
                block, lang = [], line[3:].strip()
            else:
                if lang in ("", "bash", "sh", "console"):
                    blocks.append("\n".join(block))
                block = None
        elif block is not None:
            block.append(line)
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line.startswith("#"):
                continue
            found += split_chain(line)
    found += [part for c in re.findall(r"`([^`\n]+)`", text) if c.split()[0] in STARTS for part in split_chain(c)]
    return [c for c in found if c.split()[0].split("=")[0] not in ("export",) and _program(c)]


def split_chain(line):
    """`a && b; c & d` -> [a, b, c, d]"""
    return [part.strip() for part in re.split(r"&&|;|(?<![&>])&(?!&)", line) if part.strip()]


def _program(command):
    """The words of a command from its program on (environment assignments dropped), or None."""
    plain = [w for w in command.split() if not re.fullmatch(r"[A-Z_]+=\S*", w)]
    if not plain or plain[0] not in STARTS:
        return None
    return [w for w in shlex.split(command) if not re.fullmatch(r"[A-Z_]+=\S*", w)]


def argparse_flags(path):
    return set(re.findall(r"add_argument\(\s*\"(--[a-z_]+)\"", path.read_text()))


TRAIN_KEYS = {f.name for f in dataclasses.fields(TrainConfig)} | {f.name for f in dataclasses.fields(GPTConfig)}
MAKE_TARGETS = set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.M))


def check(command):
    """The problems of one command: what it names that does not exist."""
    words = _program(command)
    if words[0] == "make":
        return [f"make target {t!r}" for t in words[1:] if not t.startswith("-") and t not in MAKE_TARGETS]
    args = words[1:]
    while args and args[0].startswith("--") and words[0] == "torchrun":  # torchrun's own flags
        args = args[1:]
    if args[:1] == ["-m"]:
        module = args[1]
        script = ROOT / (module.replace(".", "/") + ".py")
        if not module.startswith("tools.") or not script.exists():
            return [f"module {module!r}"] if module.startswith("tools.") else []
        args = args[2:]
    else:
        if not args or not args[0].endswith(".py"):
            return []
        script = ROOT / args[0]
        if not script.exists():
            return [f"file {args[0]!r}"]
        args = args[1:]
    problems = []
    for a in args:
        if a.startswith("configs/") and not (ROOT / a).exists():
            problems.append(f"config {a!r}")
        if a.startswith("--"):
            flag = a.split("=")[0]
            if script.name == "train.py":
                if flag[2:] not in TRAIN_KEYS | {"help"}:
                    problems.append(f"train.py key {flag!r}")
            elif flag not in argparse_flags(script) | {"--help"}:
                problems.append(f"{script.relative_to(ROOT)} flag {flag!r}")
    return problems


ALL = [(page.relative_to(ROOT), c) for page in PAGES for c in commands(page.read_text())]


def test_the_pages_hold_commands():
    assert len(ALL) > 40 and any(c.startswith("python -m experiments.sweep") for _, c in ALL)


@pytest.mark.parametrize("page, command", ALL, ids=[f"{p}:{c[:60]}" for p, c in ALL])
def test_every_command_names_what_exists(page, command):
    assert check(command) == [], f"{page}: {command}"


def test_a_wrong_command_is_caught():
    assert check("python sweep.py experiments/configs/sweep_cpu.py") == ["file 'sweep.py'"]
    assert check("python -m tools.sweeps experiments/configs/sweep_cpu.py") == ["module 'tools.sweeps'"]
    assert check("python train.py configs/demo.py --residuals=rd_attnres") == ["train.py key '--residuals'"]
    assert check("python -m tools.bench --vocab 512") == ["tools/bench.py flag '--vocab'"]
    assert check("python train.py configs/nope.py") == ["config 'configs/nope.py'"]
    assert check("make tests") == ["make target 'tests'"]


def reading_links(text):
    """(name, file) of every `[`name`](file)` link into the code in the README's reading order."""
    section = text.split("## Read the code in this order", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"\[`([\w.]+)`\]\(([\w/]+\.py)\)", section)


def test_the_reading_order_names_what_its_files_hold():
    """Each link of "Read the code in this order" names a `def` or `class` of its file (a method: `Class.method`,
    its `def` inside the class): when the code is renamed, this says which link went stale."""
    links = reading_links((ROOT / "README.md").read_text())
    assert len(links) >= 8
    for name, path in links:
        text = (ROOT / path).read_text()
        owner, _, leaf = name.rpartition(".")
        body = re.split(rf"^class {owner}\b", text, maxsplit=1, flags=re.M)[1:] if owner else [text]
        body = [re.split(r"^\S", b.split("\n", 1)[-1], maxsplit=1, flags=re.M)[0] for b in body] if owner else body
        pattern = rf"^\s+def {leaf}\b" if owner else rf"^(def|class) {leaf}\b"
        assert body and re.search(pattern, body[0], re.M), f"README links {name} in {path}, which holds no such name"


@pytest.mark.parametrize("package", ["tools"])
def test_a_package_s_docstring_lists_every_module(package):
    """tools/__init__.py names each of its modules, one a line."""
    listed = set(re.findall(r"^ {4}(\w+(?:, \w+)*)\s", (ROOT / package / "__init__.py").read_text(), re.M))
    listed = {name for line in listed for name in line.split(", ")}
    modules = {p.stem for p in (ROOT / package).glob("*.py")} - {"__init__"}
    assert modules - listed == set(), f"{package}/__init__.py does not list {sorted(modules - listed)}"
