"""The users' tools, each run from the repository root as `python -m tools.<name>`:

    diagnose        what the routing learned; validation curves
    bench           speed and memory against standard, in one run
    gpu_check       the one-command check on a CUDA machine (make gpu-check)

Here: what they share (and experiments/ with them): plots and the check that an output directory takes a file.
"""

import os
import sys
from pathlib import Path

from common import write_atomic


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None with a note when matplotlib is not installed."""
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
    """That `directory` takes a file, before the work whose result goes there (an OSError if not)."""
    probe = Path(directory) / f".probe.{os.getpid()}"
    with open(probe, "wb"):
        pass
    probe.unlink()
