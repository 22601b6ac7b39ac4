"""Tools (`python -m tools.<name>`) and their helpers:

    diagnose    what the routing learned
    bench       speed and memory
    gpu_check   checks on a CUDA GPU
"""

import os
import sys
from pathlib import Path

from common import read_json, write_atomic


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
    return path


def ours(path):
    """Whether a tool may write `path`: absent, a tool's PNG (or an older one's) or diagnose's diagnostics.json."""
    p = Path(path)
    if not p.is_file():
        return not p.exists()
    if p.suffix == ".json":  # a JSON object naming its checkpoint and residual
        return {"checkpoint", "residual"} <= set(read_json(p) or {})
    head = p.read_bytes()[:65536]
    return head.startswith(b"\x89PNG\r\n\x1a\n") and (MARK.encode() in head or b"Matplotlib" in head)  # (older tools')


def check_writable(directory):
    """OSError unless `directory` takes files."""
    probe = Path(directory) / f".probe.{os.getpid()}"
    open(probe, "wb").close()
    probe.unlink()
