"""What a command may write into an output directory, and what `--overwrite` / `overwrite=true` may replace: one
rule for every job (docs/reliability.md, "Output directories").

A command writes only where it is asked to, and replaces only what the suite itself wrote there. Before anything
is written, `claim_output_dir` refuses an output directory that
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

import errno
import fnmatch
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from neobert.errors import ConfigError
from neobert.layout import (AVERAGING_JSON, CHECKPOINT_DIR, CONFIG_NAME, EMA_EXPORT_DIR, GLUE_BEST_DIR,
                            GLUE_PREDICTIONS_DIR, GLUE_SWEEP_JSON, GLUE_SWEEP_MD, GPU_CHECK_JSON,
                            GPU_CHECK_LOOP_PROFILE_CSV, GPU_CHECK_LOOP_PROFILE_NAMES_CSV, GPU_CHECK_LOOP_TRACE,
                            GPU_CHECK_MD, GPU_CHECK_PLAIN_RUN, GPU_CHECK_PROFILE_CSV, GPU_CHECK_PROFILE_NAMES_CSV,
                            GPU_CHECK_RECIPE_RUN, GPU_CHECK_TRACE, MATRYOSHKA_JSON, RESULTS_JSON, TOKENIZER_FILES,
                            WEIGHTS_NAME)

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
    included = f", {flag} included" if flag else ""
    for label, path in inputs:
        if path is not None and Path(path).exists() and is_within(path, directory):
            raise ConfigError(f"{where} holds this command's input {label}: an output never goes where its inputs "
                              f"are{included}; choose another {noun}")
    checkpoints = holds_checkpoints(directory)
    if checkpoints:
        raise ConfigError(f"{where} holds checkpoints ({listing(checkpoints)}): an output never replaces a run's "
                          f"checkpoints{included}; choose another {noun}")
    entries = sorted(directory.iterdir(), key=lambda p: p.name)
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
