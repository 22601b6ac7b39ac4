"""Tools (`python -m tools.<name>`) and their helpers:

    diagnose    what the routing learned
    bench       speed and memory
    gpu_check   checks on a CUDA GPU
"""

import json
import os
import sys
from pathlib import Path

from common import write_atomic


def pyplot():
    """matplotlib.pyplot (Agg), or None if absent."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        print("matplotlib is not installed: skipping plots (pip install matplotlib)", file=sys.stderr)
        return None


MARK = "depth-routing tools"  # the Software text of every PNG the tools write: they write over no other


def write_figure(path, fig):
    import matplotlib.pyplot as plt
    try:
        write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=120, metadata={"Software": MARK}))
    finally:
        plt.close(fig)


def ours(path, keys=("checkpoint", "residual")):
    """Whether a tool may write `path`: absent, a tool's PNG (or an older version's, by matplotlib), or a JSON object
    with `keys` (a tool's record)."""
    p = Path(path)
    if not p.exists() or not p.is_file():
        return not p.exists()
    head = p.read_bytes()[:65536]
    if p.suffix == ".json":
        try:
            return isinstance(record := json.loads(p.read_bytes()), dict) and all(k in record for k in keys)
        except ValueError:
            return False
    return head.startswith(b"\x89PNG\r\n\x1a\n") and (MARK.encode() in head or b"Matplotlib" in head)  # (older tools')


def check_writable(directory):
    """OSError unless `directory` takes files."""
    probe = Path(directory) / f".probe.{os.getpid()}"
    open(probe, "wb").close()
    probe.unlink()
