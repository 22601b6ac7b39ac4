"""
Write an FSDP run's sharded checkpoint (RUN_DIR/ckpt/, depthres/checkpoint.py) as one file: the
checksummed ckpt.pt that sample.py, tools/diagnose.py and experiments/rescore.py read, and that any run
resumes from (one process, DDP or FSDP), bit for bit the state the shards hold.

    python -m tools.export_ckpt runs/x                  # writes runs/x/ckpt.pt (not while the run runs)
    python -m tools.export_ckpt runs/x --out x.pt       # elsewhere

The whole state (weights and AdamW, 12 bytes a parameter) is gathered in this one process. A run
directory holding both keeps its sharded checkpoint for FSDP resumes; the next checkpoint the run
writes replaces both. It never writes inside the checkpoint it reads, nor into another run's
directory (whose --resume=true would continue from the export) or over an existing file unless told
to (--overwrite), and never into a run directory that a live run holds locked. Exit status: 0 done; 2
with one `error:` line (no sharded checkpoint, a corrupt one, an --out refused, a run directory in
use or that cannot be written).
"""

import argparse
import sys

from depthres import cli
from depthres.checkpoint import export


def main(argv=None):
    """The command line; its exit status (depthres.cli)."""
    return cli(run, argv)


def run(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory holding a sharded checkpoint, or its ckpt/")
    p.add_argument("--out", default=None, help="the file to write (default: RUN_DIR/ckpt.pt)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --out, or write into another run's directory")
    args = p.parse_args(argv)
    out, step = export(args.run_dir, args.out, args.overwrite)
    print(f"wrote {out} (step {step})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
