"""The run machinery that train.py, sample.py and the tools share; model.py knows nothing of it.

    config        train.py's keys, their parsing and the model config built from them
    files         atomic writes (a plot too) and directory locks
    token_data    tokenizers, the token-shard format, meta.json and the loaders
    checkpoint    the run directory, its claim, its checksummed checkpoints (one file, or sharded)
    runlog        log lines, log.jsonl, W&B, progress and MFU
    distributed   how ranks share a run: DDP, FSDP2 from the meta device, agreed errors
    sources       where prepare_data.py's documents come from
    run           a training run's machinery: opening it, its log, signals, divergence, evaluation, summary

Here: what every command does with what goes wrong. A user error (bad input, or what the machine refused:
a full disk, a path the OS will not take) is a UserError, one line that says what to do, said before any
compute where the input allows; a programming error is an assert or a traceback. Every command line runs
its main through cli(), and so exits with:

    0    done
    1    tools.gpu_check: a check failed (its summary says which)
    2    one `error:` line (a UserError or an OSError)
    3    experiments.sweep: done, but some runs diverged (they are tabulated as diverged)
    4    experiments.sweep: done, but a twin did not match its twin
    128 + N    stopped by signal N (130: Ctrl-C; 143: SIGTERM), after saying what was kept
"""

import errno
import gc
import os
import sys

EXIT_ERROR = 2


class UserError(ValueError):
    """Bad input, or what the machine refused: one line that says what to do. `result`: what was computed
    before it went wrong (a command prints it, so that nothing computed is lost)."""

    def __init__(self, message, result=None):
        super().__init__(message)
        self.result = result


class Stopped(KeyboardInterrupt):
    """A command stopped by signal `signum` (SIGINT: Ctrl-C, SIGTERM), after cleaning up; the message says
    what was kept. Exit status 128 + signum."""

    def __init__(self, message, signum=2):
        super().__init__(message)
        self.signum = signum


def os_error_message(e, path=None):
    """One line for an OSError: met while writing `path`, or (None) on whatever file it names."""
    reason = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
              errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
              errno.EPERM: "permission denied", errno.ENAMETOOLONG: "the name is longer than the OS allows",
              errno.ELOOP: "it is a symbolic link (remove it: nothing here is written through a link)",
              }.get(e.errno, e.strerror or str(e))
    if path is None:
        return f"{e.filename}: {reason}" if e.filename else reason
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{reason} writing {path}"
    return f"cannot write {path}: {reason}"


def cli(main, argv=None):
    """main(argv) as a command line: its exit status (an int it returns; anything else: 0), EXIT_ERROR after one
    `error:` line for a UserError or an OSError, 128 + signum after a stop (Ctrl-C: its line, or 'interrupted')."""
    try:
        status = main(argv)
        return status if isinstance(status, int) else 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_ERROR
    except BrokenPipeError:  # stdout's reader (`| head`) has what it wants: silence the flush at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:  # a path the OS refuses, a disk that fills outside a guarded write
        print(f"error: {os_error_message(e)}", file=sys.stderr, flush=True)
        return EXIT_ERROR
    except KeyboardInterrupt as e:
        if int(os.environ.get("RANK", 0)) == 0:
            print(str(e) or "interrupted", file=sys.stderr, flush=True)
        return 128 + getattr(e, "signum", 2)
    finally:
        # A traceback kept its frames alive: free what they hold (FSDP's and DDP's models sit in reference
        # cycles with their process group) now, not in interpreter teardown, where gloo's threads are
        # destroyed unjoined and abort the process (exit -6)
        gc.collect()
