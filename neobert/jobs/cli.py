"""The one way every `python -m experiments.<job>` command line ends: a user error (a bad config or key, a missing
file, bad data, an unusable checkpoint, an unreachable hub, a read-only or full disk) is ONE line on stderr,
`error: <message>`, and exit status 2; a real bug keeps its traceback (and Python's exit status 1).
`--debug` on the command line (every parser gets it from `add_debug_flag`) or NEOBERT_DEBUG=1 shows the traceback
of a user error too.

    if __name__ == "__main__":
        sys.exit(run_cli(main))

`main(argv)` itself is untouched: called in-process (tests, notebooks) it returns its result and raises as before.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import re
import sys
from typing import Any, Callable, Sequence

import torch

from neobert.errors import UserInputError
from neobert.hub import HubUnreachableError

DEBUG_FLAG = "--debug"
DEBUG_ENV = "NEOBERT_DEBUG"
USER_ERROR_STATUS = 2
INTERRUPTED_STATUS = 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C
# Errors that are the input's or the machine's, never the code's.
USER_ERRORS = (UserInputError, HubUnreachableError, FileNotFoundError, NotADirectoryError, IsADirectoryError)
# OS errors of the same kind: no permission to write output_dir, a read-only file system, a full disk or quota.
USER_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT})
# A DataLoader worker's exception comes back wrapped: "Caught X in DataLoader worker process 0.\nOriginal Traceback..."
_WORKER_TRACEBACK = re.compile(r"Original Traceback \(most recent call last\):\n.*?^([\w.]+: )?(?P<message>[^\n]*)\n*\Z",
                               re.S | re.M)


def print_report(paths: dict) -> None:
    """What a reporting job wrote: its Markdown report (`paths["markdown"]`) in full, then every file's path."""
    print(paths["markdown"].read_text())
    for kind, path in paths.items():
        print(f"{kind}: {path}")


def add_debug_flag(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds `--debug` (show the traceback of an input error) to a command line's parser."""
    parser.add_argument(DEBUG_FLAG, action="store_true",
                        help=f"show the full traceback of an input error (or set {DEBUG_ENV}=1)")
    return parser


def parse_fine_tuning_args(doc: str, tasks: list[str], config_family: str, argv: list[str] | None):
    """The command line of a fine-tuning job (GLUE, NER): --task, --model, --config, --sweep, --threads, key=value
    overrides, --debug; sets the torch threads and the log format."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", required=True, choices=tasks)
    parser.add_argument("--model", help="our export dir, a local Hugging Face dir, a hub name, or preset:tiny")
    parser.add_argument("--config", help=f"YAML config: a path or a packaged name (default: {config_family}/<task>)")
    parser.add_argument("--sweep", action="store_true", help="run the grid of `sweep.*` and report the median")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0 = torch's default)")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    add_debug_flag(parser)
    args = parser.parse_intermixed_args(argv)  # key=value overrides may follow any flag
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def is_user_error(err: BaseException) -> bool:
    if isinstance(err, USER_ERRORS):
        return True
    return isinstance(err, OSError) and err.errno in USER_ERRNOS


def debug_requested(argv: Sequence[str]) -> bool:
    return DEBUG_FLAG in argv or os.environ.get(DEBUG_ENV, "0").lower() in ("1", "true", "yes", "on")


def one_line(err: BaseException) -> str:
    """The message of `err` on one line; from a DataLoader worker, the original exception's message."""
    message = str(err)
    worker = _WORKER_TRACEBACK.search(message)
    if worker:
        message = worker.group("message")
    elif isinstance(err, OSError) and err.strerror:  # "[Errno 28] No space left on device" without the number
        message = f"{err.strerror}: {err.filename!r}" if err.filename else err.strerror
    return " ".join(message.split()) or type(err).__name__


def run_cli(main: Callable[[list[str]], Any], argv: Sequence[str] | None = None) -> int:
    """Runs `main(argv)` (default: sys.argv[1:]) and returns the exit status: 0, 2 after printing a user error
    as one line on stderr, or 130 after a Ctrl-C (one line: for a run, where it stopped and how to resume). With --debug or NEOBERT_DEBUG=1 a user error is re-raised with its traceback; any other
    exception always is (a bug)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        main(argv)
    except KeyboardInterrupt as err:  # Ctrl-C: a line (where a run stopped, how to resume), the shell's status
        print(f"interrupted{': ' + str(err) if str(err) else ''}", file=sys.stderr, flush=True)
        return INTERRUPTED_STATUS
    except Exception as err:  # sorted below: only user errors end here
        if not is_user_error(err) or debug_requested(argv):
            raise
        print(f"error: {one_line(err)}", file=sys.stderr, flush=True)
        return USER_ERROR_STATUS
    return 0
