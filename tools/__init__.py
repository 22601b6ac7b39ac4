"""Tools (`python -m tools.<name>`) and their helpers:

    diagnose    what the routing learned
    bench       speed and memory
    gpu_check   checks on a CUDA GPU
"""

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


def write_figure(path, fig):
    import matplotlib.pyplot as plt
    try:
        write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=120))
    finally:
        plt.close(fig)


def check_writable(directory):
    """OSError unless `directory` takes files."""
    probe = Path(directory) / f".probe.{os.getpid()}"
    open(probe, "wb").close()
    probe.unlink()
