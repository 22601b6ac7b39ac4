"""Every command in the README and docs/ runs as written: each names a file, module, config, make
target and flag that exists. Commands are read from fenced code blocks and from inline code that
starts like a command (`python ...`, `make ...`, `torchrun ...`)."""

import dataclasses
import re
import shlex

import pytest

from common import ROOT
from model import GPTConfig
from train import TrainConfig

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
STARTS = ("python", "python3", "torchrun", "make", ".venv/bin/python")


def commands(text):
    """A page's command lines: fenced blocks (continuations joined, comments dropped), inline code that starts like one."""
    found = []
    for lang, block in re.findall(r"^```(.*)\n((?:(?!```).*\n)*?)```", text, re.M):  # a fenced block: its language, lines
        if lang.strip() not in ("", "bash", "sh", "console"):
            continue
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if not line.startswith("#"):
                found += split_chain(line)
    found += [part for c in re.findall(r"`([^`\n]+)`", text) if c.split()[0] in STARTS for part in split_chain(c)]
    return [c for c in found if _program(c)]


def split_chain(line):
    """`a && b; c & d` -> [a, b, c, d]"""
    return [part.strip() for part in re.split(r"&&|;|(?<![&>])&(?!&)", line) if part.strip()]


def _program(command):
    """The words of a command from its program on (environment assignments dropped), or None."""
    plain = [w for w in command.split() if not re.fullmatch(r"[A-Z_]+=\S*", w)]
    if not plain or plain[0] not in STARTS:
        return None
    return [w for w in shlex.split(command) if not re.fullmatch(r"[A-Z_]+=\S*", w)]


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
    if args[:1] == ["-m"] and args[1].startswith("tools."):  # (other modules: not checked)
        name, script, args = f"module {args[1]!r}", ROOT / (args[1].replace(".", "/") + ".py"), args[2:]
    elif args[:1] != ["-m"] and args and args[0].endswith(".py"):
        name, script, args = f"file {args[0]!r}", ROOT / args[0], args[1:]
    else:
        return []
    if not script.exists():
        return [name]
    if script.name == "train.py":
        what, known = "train.py key", {f"--{k}" for k in TRAIN_KEYS}
    else:
        what, known = f"{script.relative_to(ROOT)} flag", set(re.findall(r"add_argument\(\s*\"(--[a-z_]+)\"", script.read_text()))
    flags = [a.split("=")[0] for a in args if a.startswith("--")]
    return [f"config {a!r}" for a in args if a.startswith("configs/") and not (ROOT / a).exists()] + \
        [f"{what} {flag!r}" for flag in flags if flag not in known | {"--help"}]


ALL = [(page.relative_to(ROOT), c) for page in PAGES for c in commands(page.read_text())]


@pytest.mark.parametrize("page, command", ALL, ids=[f"{p}:{c[:60]}" for p, c in ALL])
def test_every_command_names_what_exists(page, command):
    assert check(command) == [], f"{page}: {command}"


def test_the_pages_hold_commands_and_a_wrong_one_is_caught():
    assert len(ALL) > 40 and any(c.startswith("python -m experiments.sweep") for _, c in ALL)
    assert check("python sweep.py experiments/configs/sweep_cpu.py") == ["file 'sweep.py'"]
    assert check("python -m tools.sweeps experiments/configs/sweep_cpu.py") == ["module 'tools.sweeps'"]
    assert check("python train.py configs/demo.py --residuals=rd_attnres") == ["train.py key '--residuals'"]
    assert check("python -m tools.bench --vocab 512") == ["tools/bench.py flag '--vocab'"]
    assert check("python train.py configs/nope.py") == ["config 'configs/nope.py'"]
    assert check("make tests") == ["make target 'tests'"]


def test_the_reading_order_names_what_its_files_hold():
    """Each link of "Read the code in this order" (`[`name`](file)`) names a `def` or `class` of its file (a method:
    `Class.method`, its `def` inside the class): when the code is renamed, this says which link went stale."""
    section = (ROOT / "README.md").read_text().split("## Read the code in this order", 1)[1].split("\n## ", 1)[0]
    links = re.findall(r"\[`([\w.]+)`\]\(([\w/]+\.py)\)", section)
    assert len(links) >= 8
    for name, path in links:
        text = (ROOT / path).read_text()
        owner, _, leaf = name.rpartition(".")
        body = re.split(rf"^class {owner}\b", text, maxsplit=1, flags=re.M)[1:] if owner else [text]
        body = [re.split(r"^\S", b.split("\n", 1)[-1], maxsplit=1, flags=re.M)[0] for b in body] if owner else body
        pattern = rf"^\s+def {leaf}\b" if owner else rf"^(def|class) {leaf}\b"
        assert body and re.search(pattern, body[0], re.M), f"README links {name} in {path}, which holds no such name"


def test_the_tests_the_docs_cite_exist():
    """A test the pages cite by name (`test_...`, docs/reliability.md's table) is defined: a renamed test renames it there."""
    files = [ROOT / "test_equivalence.py", *ROOT.glob("tests/*.py"), *ROOT.glob("experiments/tests/*.py")]
    defined = set(re.findall(r"^def (test_\w+)", "".join(f.read_text() for f in files), re.M))
    cited = {name for page in PAGES for name in re.findall(r"`(test_\w+)`", page.read_text())}
    assert len(cited) > 20 and cited - defined == set()


def test_tools_docstring_lists_every_module():
    """tools/__init__.py names each of its modules, one a line."""
    listed = set(re.findall(r"^ {4}(\w+(?:, \w+)*)\s", (ROOT / "tools" / "__init__.py").read_text(), re.M))
    listed = {name for line in listed for name in line.split(", ")}
    modules = {p.stem for p in (ROOT / "tools").glob("*.py")} - {"__init__"}
    assert modules - listed == set(), f"tools/__init__.py does not list {sorted(modules - listed)}"
