"""What a command may write into an output directory, and what `--overwrite` / `overwrite=true` may replace: one
rule for every job (docs/reliability.md, "Output directories").

A command writes only where it is asked to, and replaces only what the suite itself wrote there. One run writes
an output directory at a time: a run holds its own for its lifetime (`hold_output_dir`). Before anything
is written, `claim_output_dir` refuses an output directory that
* another live run holds;
* holds one of the command's own inputs (a checkpoint it reads, the data, the model it starts from): an output
  never goes where its inputs are, whatever `overwrite` says;
* holds checkpoints (a run directory, or its `checkpoints/`): nothing replaces a run's checkpoints;
* of a kind written as a whole (an export, a tokenizer), holds anything that is not part of that kind;
* holds an earlier output of the suite (`OutputKind.names`, `OutputKind.patterns`), unless `overwrite` says to
  replace it; and returns those earlier entries. Only they are ever removed (`clear_output_dir`), or the directory
  as a whole is swapped for a complete new one (`replace_directory`), built in a fresh `staging_dir` beside it.
Names are those of `neobert.layout`; the few written by others (transformers' tokenizer files) are listed here.
A disk without room for an output is an OSError (ENOSPC) saying what did not fit, where, and what was kept
(`check_free_space` before a write whose size is known, `out_of_space` after one that filled the disk).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import fnmatch
import itertools
import json
import logging
import os
import shlex
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Mapping

from neobert.errors import ConfigError
from neobert.layout import (AVERAGING_JSON, CHECKPOINT_DIR, CONFIG_NAME, EMA_EXPORT_DIR, GLUE_BEST_DIR,
                            GLUE_PREDICTIONS_DIR, GLUE_SWEEP_JSON, GLUE_SWEEP_MD, GPU_CHECK_JSON,
                            GPU_CHECK_LOOP_PROFILE_CSV, GPU_CHECK_LOOP_PROFILE_NAMES_CSV, GPU_CHECK_LOOP_TRACE,
                            GPU_CHECK_MD, GPU_CHECK_PLAIN_RUN, GPU_CHECK_PROFILE_CSV, GPU_CHECK_PROFILE_NAMES_CSV,
                            GPU_CHECK_RECIPE_RUN, GPU_CHECK_TRACE, MATRYOSHKA_JSON, RESULTS_JSON, RUN_LOCK,
                            THROUGHPUT_CSV, THROUGHPUT_MD, THROUGHPUT_PLOT, THROUGHPUT_PROFILE_CSV,
                            THROUGHPUT_PROFILE_NAMES_CSV, THROUGHPUT_TRACES_DIR, TOKENIZER_FILES, WEIGHTS_NAME)

log = logging.getLogger(__name__)

# Written by transformers' save_pretrained beside TOKENIZER_FILES (by some of its versions).
HF_TOKENIZER_EXTRAS = ("special_tokens_map.json", "added_tokens.json")
PHASE_DONE_NAME = "phase.json"  # neobert.jobs.phases.PHASE_DONE: a phase's export is complete
STAGING_SUFFIX = ".partial"  # `staging_dir`: .<target>.<random>.partial, beside the target


@dataclass(frozen=True)
class OutputKind:
    """What the suite writes into one kind of output directory."""

    content: str  # "an export": messages say what is not part of it
    names: tuple[str, ...]  # the entries the suite writes (files or folders), in the order messages list them
    patterns: tuple[str, ...] = ()  # fnmatch patterns of further entries it writes (run folders, shards)
    whole: bool = False  # written only as a whole: nothing else may be in it (else: others' files stay, untouched)

    def owns(self, name: str) -> bool:
        return name in self.names or any(fnmatch.fnmatchcase(name, p) for p in self.patterns)


TOKENIZER = OutputKind("a tokenizer", tuple(sorted(TOKENIZER_FILES + HF_TOKENIZER_EXTRAS)), whole=True)
# A model directory in the hub layout (experiments.export, the pretraining job's export/, a phase's export/<name>/);
# <name>.tmp: checkpoint.save_pretrained's files before their rename.
EXPORT = OutputKind("an export", tuple(sorted((AVERAGING_JSON, CONFIG_NAME, EMA_EXPORT_DIR, MATRYOSHKA_JSON,
                                               PHASE_DONE_NAME, WEIGHTS_NAME) + TOKENIZER.names)),
                    patterns=(f"{WEIGHTS_NAME}.tmp", f"{CONFIG_NAME}.tmp"), whole=True)
# A fine-tuning task directory (GLUE, NER: output_dir/<task>/): the finished run's files first, then the runs
# (neobert.jobs.finetune.run_name: bs<batch>_lr<lr>_wd<wd>_seed<seed>).
FINETUNE_TASK = OutputKind("a fine-tuning task", (RESULTS_JSON, GLUE_BEST_DIR, GLUE_SWEEP_JSON, GLUE_SWEEP_MD,
                                                  GLUE_PREDICTIONS_DIR), patterns=("bs*_lr*_wd*_seed*",))
# --pretokenize: neobert.data.corpus.pretokenize's shards, and a shard's file before its rename.
SHARDS = OutputKind("a pretokenization", (), patterns=("shard-*.parquet", "shard-*.parquet.tmp"))
GPU_CHECK = OutputKind("a GPU check", (GPU_CHECK_RECIPE_RUN, GPU_CHECK_PLAIN_RUN, GPU_CHECK_MD, GPU_CHECK_JSON,
                                       GPU_CHECK_TRACE, GPU_CHECK_PROFILE_CSV, GPU_CHECK_PROFILE_NAMES_CSV,
                                       GPU_CHECK_LOOP_TRACE, GPU_CHECK_LOOP_PROFILE_CSV,
                                       GPU_CHECK_LOOP_PROFILE_NAMES_CSV))
# experiments.throughput's report (the measured rows, their tables and plot; with profile=true the profiles');
# .throughput.csv.partial: its CSV before the rename (neobert.layout.write_atomically).
THROUGHPUT = OutputKind("a throughput report", (THROUGHPUT_CSV, THROUGHPUT_MD, THROUGHPUT_PLOT, THROUGHPUT_PROFILE_CSV,
                                               THROUGHPUT_PROFILE_NAMES_CSV, THROUGHPUT_TRACES_DIR),
                        patterns=(f".{THROUGHPUT_CSV}.partial",))


def listing(names: Iterable[str], limit: int = 4) -> str:
    names = list(names)
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")


def is_within(path: str | Path, directory: str | Path) -> bool:
    """Whether `path` is `directory` or lies inside it (symbolic links and `..` resolved)."""
    path, directory = Path(path).resolve(), Path(directory).resolve()
    return path == directory or directory in path.parents


def holds_checkpoints(directory: Path) -> list[str]:
    """The entries of `directory` that are checkpoints: `checkpoints/`, a `*.ckpt` file or checkpoint folder."""
    return sorted(p.name for p in directory.iterdir() if p.name == CHECKPOINT_DIR or p.suffix == ".ckpt")


# ---------------------------------------------------------------------------------------------- one run per directory
# The variables a launcher sets in the processes it starts, as Lightning reads them (lightning.fabric.utilities.
# rank_zero, plugins/environments): RANK, the global rank itself (torchrun, kubeflow, DeepSpeed's launcher); then
# Lightning's own launcher, which re-runs the command with LOCAL_RANK set for each further device of a node, a node
# other than the first having NODE_RANK (or torchelastic's GROUP_RANK) set; then srun's, jsrun's (LSF) and mpirun's.
LIGHTNING_RANKS = ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK")
SCHEDULER_RANKS = ("SLURM_PROCID", "JSM_NAMESPACE_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
# What flock raises where the file system keeps no locks (Lustre without -o flock, some NFS mounts).
NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)
NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)
COMMAND_SHOWN = 300  # characters of the holder's command line in a refusal


def is_global_rank_zero(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process is rank 0 of its run (any process without a launcher is): the one process of a run,
    whatever its devices and nodes, that holds its output directory and writes its shared files."""
    if "RANK" in environ:
        return int(environ["RANK"]) == 0
    lightning = [int(environ[key]) for key in LIGHTNING_RANKS if key in environ]
    if lightning:
        return not any(lightning)
    return next((int(environ[key]) for key in SCHEDULER_RANKS if key in environ), 0) == 0


@dataclass
class _Hold:
    lock: int  # the open lock file, flock'ed: the kernel releases it when this process ends, however it ends
    path: Path
    created: list[Path]  # the folders taking the hold made, innermost first: removed on leaving when still empty


_HELD: dict[Path, _Hold] = {}  # this process's holds, by resolved directory


@contextlib.contextmanager
def hold_output_dir(directory: str | Path, where: str | None = None, noun: str = "output_dir") -> Iterator[bool]:
    """Holds `directory` for one run while the block runs: a second run into it, from any process on any machine
    sharing the file system, is refused (a ConfigError naming the holder: pid, host, start, command), before it
    writes or removes anything. The hold is an OS lock on `directory/RUN_LOCK`, so it ends with the process that
    took it, a kill -9 included; the file a killed run leaves behind blocks no one. Only rank 0 of a run holds
    (`is_global_rank_zero`): the ranks a launcher starts belong to the run that holds. A process holding
    `directory` already holds it again (a phase of a recipe, a resume inside the run); a folder inside it is
    another directory. Yields whether this process is the run's writer (False: another rank of the run), the one
    that may clean up after earlier runs. `where` begins the refusal (default "output_dir='<directory>'");
    `noun` ends it ("choose another <noun>")."""
    directory, key = Path(directory), Path(directory).resolve()
    if not is_global_rank_zero() or key in _HELD:
        yield key in _HELD
        return
    hold = _take(key, where or f"output_dir={str(directory)!r}", noun)
    if hold is not None:
        _HELD[key] = hold
    try:
        yield True
    finally:
        if hold is not None:
            del _HELD[key]
            _release(hold)


def _take(directory: Path, where: str, noun: str) -> _Hold | None:
    """The hold of `directory`, or None where it cannot be had: a directory this process cannot write (its first
    write says so) or a file system without locks (warned). `directory`: resolved (a later chdir changes nothing)."""
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"{where} is a file, not a directory")
    created = list(itertools.takewhile(lambda folder: not folder.exists(), (directory, *directory.parents)))
    while True:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            lock = os.open(directory / RUN_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            continue  # the run leaving it removed the folder it had made: make it again
        except OSError as err:
            if err.errno not in NOT_WRITABLE:
                raise
            return None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(lock)
            os.close(lock)
            raise in_use(where, noun, holder) from None
        except OSError as err:
            os.close(lock)
            if err.errno not in NO_LOCKS:
                raise
            log.warning("%s: the file system keeps no locks (%s): a second run into it is not refused", directory,
                        err.strerror)
            return None
        if _same_file(lock, directory / RUN_LOCK):
            break
        os.close(lock)  # the run before removed this file on leaving: lock the one there now
    command = shlex.join([Path(sys.orig_argv[0]).name, *sys.orig_argv[1:]])
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "command": command,
              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    os.ftruncate(lock, 0)  # the file a killed run left names a holder that is gone
    os.write(lock, json.dumps(holder).encode())
    return _Hold(lock, directory / RUN_LOCK, created)


def _release(hold: _Hold) -> None:
    if _same_file(hold.lock, hold.path):  # removed while still locked: no one takes a file on its way out
        hold.path.unlink()
    fcntl.flock(hold.lock, fcntl.LOCK_UN)  # a forked DataLoader worker may share the lock: end it for all
    os.close(hold.lock)
    for folder in hold.created:
        try:
            folder.rmdir()  # a run refused by its own checks leaves no folder behind
        except OSError:
            break


def _same_file(lock: int, path: Path) -> bool:
    try:
        there, held = os.stat(path), os.fstat(lock)
    except FileNotFoundError:
        return False
    return (there.st_dev, there.st_ino) == (held.st_dev, held.st_ino)


def _holder(lock: int) -> str:
    """The holder a lock file names, in words."""
    try:
        holder = json.loads(os.pread(lock, 4096, 0))
        command = " ".join(holder["command"].split())  # one line, whatever the command held
        command = command if len(command) <= COMMAND_SHOWN else command[: COMMAND_SHOWN - 3] + "..."
        return f"pid {holder['pid']} on {holder['host']}, started {holder['started']} by `{command}`"
    except (OSError, ValueError, KeyError, TypeError):
        return "it is starting: its pid and command are not written yet"


def in_use(where: str, noun: str, holder: str) -> ConfigError:
    return ConfigError(f"{where} is in use by another run ({holder}): one run writes a directory at a time; wait "
                       f"for that run to end (or stop it), or choose another {noun}")


def running_holder(directory: str | Path) -> str | None:
    """The live run holding `directory` (`hold_output_dir`), in words, when a process other than this one holds
    it; None otherwise, and always on the other ranks of a run (its rank 0 holds for them)."""
    directory = Path(directory)
    if directory.resolve() in _HELD or not is_global_rank_zero():
        return None
    try:
        lock = os.open(directory / RUN_LOCK, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)  # taken only while this looks: closing the file ends it
    except BlockingIOError:
        return _holder(lock)
    except OSError:
        return None  # a file system without locks
    finally:
        os.close(lock)
    return None


def claim_output_dir(directory: str | Path, kind: OutputKind, *, where: str, noun: str, earlier: str = "",
                     overwrite: bool = False, flag: str | None = None,
                     inputs: Iterable[tuple[str, str | Path | None]] = ()) -> list[Path]:
    """Decides, before anything is written, whether a command may write its output into `directory` (see the
    module docstring); raises a ConfigError saying why not. Returns the suite's earlier entries there, which the
    command replaces (`clear_output_dir` or `replace_directory`); they are there only with `overwrite`.

    `where` begins each message ("export directory out"); `noun` ends it ("choose another <noun>"); `flag` is
    how the command says overwrite ("--overwrite", "overwrite=true"; None: it has none); `earlier`: the message
    for an earlier output without `overwrite`, formatted with {directory} and {held} (the entries, in the order of
    `kind.names`); `inputs`: (label, path) of
    everything the command reads, e.g. ("/runs/x/last.ckpt", path) or ("data.path='/data'", path)."""
    directory = Path(directory)
    if not directory.exists():
        return []
    if not directory.is_dir():
        raise ConfigError(f"{where} is a file, not a directory")
    holder = running_holder(directory)
    if holder is not None:
        raise in_use(where, noun, holder)
    included = f", {flag} included" if flag else ""
    for label, path in inputs:
        if path is not None and Path(path).exists() and is_within(path, directory):
            raise ConfigError(f"{where} holds this command's input {label}: an output never goes where its inputs "
                              f"are{included}; choose another {noun}")
    checkpoints = holds_checkpoints(directory)
    if checkpoints:
        raise ConfigError(f"{where} holds checkpoints ({listing(checkpoints)}): an output never replaces a run's "
                          f"checkpoints{included}; choose another {noun}")
    # RUN_LOCK (a run's hold): neither someone else's file nor an earlier output to replace
    entries = sorted((p for p in directory.iterdir() if p.name != RUN_LOCK), key=lambda p: p.name)
    foreign = [p.name for p in entries if not kind.owns(p.name)]
    if kind.whole and foreign:
        raise ConfigError(f"{where} holds files that are not part of {kind.content} ({listing(foreign)}): it is "
                          f"written only as a whole, never beside other files{included}; move them out or choose "
                          f"another {noun}")
    own = [p for p in entries if kind.owns(p.name)]
    if own and not overwrite:
        order = {name: i for i, name in enumerate(kind.names)}
        held = sorted((p.name for p in own), key=lambda name: (order.get(name, len(order)), name))
        raise ConfigError(earlier.format(directory=directory, held=listing(held)))
    return own


def clear_output_dir(directory: str | Path, kind: OutputKind) -> list[Path]:
    """Removes the suite's own entries of `kind` from `directory` (never anything else); returns them."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = [p for p in sorted(directory.iterdir()) if kind.owns(p.name)]
    for path in removed:
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    return removed


def staging_dir(target: str | Path) -> Path:
    """A new, empty directory beside `target` (its name is taken by no one: tempfile.mkdtemp) where an output is
    written whole before it is put in place (`replace_directory`)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=STAGING_SUFFIX, dir=target.parent))


def replace_directory(new: str | Path, target: str | Path) -> None:
    """`new` (a `staging_dir`) takes `target`'s place: two renames, so `target` is always either the old directory
    or the new one, never a mix; the old one is set aside under a fresh name beside it, then removed (call it only
    once `claim_output_dir` allowed replacing it)."""
    new, target = Path(new), Path(target)
    if not target.exists():
        os.replace(new, target)
        return
    old = staging_dir(target)
    os.replace(target, old)  # onto the fresh empty directory: a rename
    os.replace(new, target)
    shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- a full disk
# Free bytes below which a failed write is taken for a full disk: torch's zip writer ("unexpected pos") and
# safetensors do not pass the operating system's errno on.
FULL_DISK_MARGIN = 1 << 20


def free_space(path: str | Path) -> int:
    """Free bytes on the file system of `path` (or of its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def megabytes(size: int) -> str:
    return f"{size / 1e6:,.1f} MB" if size >= 1e5 else f"{size / 1e3:,.0f} kB"


def out_of_space(directory: str | Path, what: str, needed: int, outcome: str, *, known: bool = True) -> OSError:
    """The error of a full disk: an OSError with ENOSPC, which every command line prints as one line, status 2.
    `needed`: the bytes `what` takes (`known`), or those written before the disk filled (more are needed)."""
    need = f"about {megabytes(needed)}" if known else f"more than the {megabytes(needed)} written before it filled"
    return OSError(errno.ENOSPC, f"no space left on device for {what} in {staged_for(directory)}: it needs {need}, "
                                 f"{megabytes(free_space(directory))} free; {outcome}")


def staged_for(directory: str | Path) -> Path:
    """The target of a `staging_dir` (.<target>.<random>.partial: what the user named); any other directory itself."""
    directory = Path(directory)
    if directory.name.startswith(".") and directory.name.endswith(STAGING_SUFFIX):
        return directory.with_name(directory.name[1:-len(STAGING_SUFFIX)].rsplit(".", 1)[0])
    return directory


def check_writable(directory: str | Path, where: str) -> None:
    """Refuses, before any work, a `directory` that cannot be created or written: the nearest existing folder on its
    path must let this user add entries (`where` begins the message, e.g. "invalid config key 'export_dir': /x")."""
    existing = Path(directory).absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{where}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{where} cannot be written: {existing} is read-only for this user (or on a read-only file "
                          f"system); choose a directory it may write")


def check_free_space(directory: str | Path, needed: int, what: str, outcome: str) -> None:
    """Refuses, before writing, `what` (about `needed` bytes) into a directory whose disk has less free."""
    if needed > free_space(directory):
        raise out_of_space(directory, what, needed, outcome)


def filled_the_disk(err: BaseException, directory: str | Path) -> bool:
    """Whether a write into `directory` failed for want of space (call it before removing what it wrote)."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if not isinstance(err, Exception):  # an interrupt
        return False
    return "No space left on device" in str(err) or free_space(directory) < FULL_DISK_MARGIN
