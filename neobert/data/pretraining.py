"""The pretraining data pipeline: documents of a corpus (`neobert.data.corpus`: hub or local files, streamed
through Hugging Face `datasets`), drawn from a mixture of sources or of length buckets (`neobert.data.mixture`),
truncation or packing, masking, and an exactly resumable stream of batches behind a LightningDataModule.

How the stream is cut up, so that nothing is duplicated and a resumed run, on any number of devices, nodes or
workers, sees the very batches an uninterrupted one would:
* The corpus is cut into `data.streams` canonical streams (``split_dataset_by_node``: whole shards when they divide
  evenly, else every n-th document), fixed for the run; every (rank, dataloader worker) pair reads whole streams and
  serves their batches in the run's one order of micro-batches (`neobert.data.stream_layout`).
* A stream reads documents in blocks of ``data.shuffle_buffer`` and shuffles each block with a seed derived
  from (seed, stream, epoch, block). Its state (`StreamState`): the source's own ``state_dict`` at the start of
  the current block, how many documents of the block were used, the packing carry-over (every token id of the
  packer's waiting and open rows) and bucket queues.
* Each batch carries the state of its stream *after* it (``batch["data_state"]``); the LightningModule
  hands it to the DataModule in ``training_step``, and the DataModule's ``state_dict`` (saved in every
  Lightning checkpoint) holds the latest state of every stream that fed a trained batch. Prefetched but
  untrained batches therefore never count. On resume each reader restarts its streams from those states.
* In the batch that state is an `EncodedStreamState` (`neobert.data.stream_state`): pickled once in the worker, a
  leaf that nothing on the way walks, decoded only for a checkpoint or a restart (`batch_stream_state`).
"""

from __future__ import annotations

import copy
import logging
import os
import random
from pathlib import Path
from typing import Iterator

import lightning as L
import torch
from datasets.distributed import split_dataset_by_node
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from neobert.data.corpus import (DocumentTokenizer, check_has_documents, document_digest, held_out_digests,
                                  local_data_files, no_usable_documents, open_source, read_blocks, source_key,
                                  text_column, truncate)
from neobert.data.masking import MLMMasker
from neobert.data.mixture import bucketed_documents, mixed_documents, mixture_sources
from neobert.data.packing import make_packer
from neobert.data.schedules import DataSchedule
from neobert.data.stream_layout import StreamLayout, legacy_streams, resume_problem
from neobert.data.stream_state import (DATA_STATE_KEY, EncodedStreamState, MixtureState, SourcePosition, StreamState,
                                       carried_state, derived_seed, source_identity)
from neobert.errors import CheckpointError, ConfigError, DataError
from neobert.hub import require_hub

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the workers tokenize; no nested thread pools
log = logging.getLogger(__name__)

SOURCE_KEY = "source"  # a validation batch's source, in a mixture
TOKENIZE_CHUNK = 256  # documents tokenized together (one encode_batch call) as a stream needs them


# ---------------------------------------------------------------------------------------------- batching
class BatchBuilder:
    """Tokenized documents -> masked batches: truncated (data.packing=none, the paper's default), each document its own
    sequence, padded or (`unpad`, data.unpad) laid end to end with cu_seqlens and no [PAD]; or packed into rows of at
    most `max_length` tokens by a `neobert.data.packing` packer (greedy or best fit)."""

    def __init__(self, masker: MLMMasker, max_length: int, packing: str, special_ids: set[int],
                 open_rows: int = 64, unpad: bool = False):
        self.masker, self.max_length, self.special_ids = masker, max_length, special_ids
        self.unpad = unpad  # packing none: the padded batch's documents and masks without its [PAD] (collate_unpadded)
        self.packer = make_packer(packing, max_length, open_rows) if packing != "none" else None
        self.pending: list[list[int]] = []  # no packing: truncated documents

    def add(self, ids: list[int]) -> None:
        if self.packer is None:
            self.pending.append(truncate(ids, self.max_length, self.special_ids))
        else:
            self.packer.add(ids)

    def ready(self, rows: int) -> bool:
        return len(self.pending) >= rows if self.packer is None else self.packer.ready(rows)

    def flush(self) -> int:
        """Closes every partly filled row; returns how many rows are waiting (for a last, smaller batch)."""
        if self.packer is None:
            return len(self.pending)
        self.packer.flush()
        return self.packer.pending_rows()

    def pop(self, rows: int, generator: torch.Generator, rate: float | None = None) -> tuple[dict, dict]:
        """The next batch of `rows` rows masked at `rate` (default: the masker's), and its statistics: rows, real
        tokens, the sum of the squared lengths of its sequences (documents; the segments of packed rows), which sets
        its attention FLOPs (`neobert.eval.flops.attention_flops`), and the masking rate (the packing efficiency is
        tokens / (rows x max_length))."""
        if self.packer is None:
            docs, self.pending = self.pending[:rows], self.pending[rows:]
            collate = self.masker.collate_unpadded if self.unpad else self.masker.collate_padded
            batch, lengths = collate(docs, generator, rate), [len(d) for d in docs]
        else:
            docs = self.packer.take(rows)
            batch, lengths = self.masker.collate_packed(docs, generator, rate), [len(s) for r in docs for s in r]
        stats = {"rows": len(docs), "tokens": sum(lengths), "squared_lengths": sum(n * n for n in lengths),
                 "mask_rate": self.masker.rate if rate is None else rate}
        return batch, stats

    def all_batches(self, documents, rows: int, generator: torch.Generator) -> Iterator[tuple[dict, dict]]:
        """Every batch of a finite set of documents, the last one smaller (validation, measurements)."""
        for ids in documents:
            self.add(ids)
            while self.ready(rows):
                yield self.pop(rows, generator)
        left = self.flush()
        if left:
            yield self.pop(left, generator)

    def state(self) -> dict:
        if self.packer is None:
            return {"pending": copy.deepcopy(self.pending)}
        return {"packer": self.packer.state()}

    def load(self, state: dict) -> None:
        if self.packer is None:
            self.pending = copy.deepcopy(state["pending"])
        else:
            self.packer.load(state["packer"])


# ---------------------------------------------------------------------------------------------- the stream


class PretrainingStream(IterableDataset):
    """An endless, exactly resumable stream of masked batches (see the module docstring).

    `world_size`/`rank` are the data-parallel ranks; every DataLoader worker is one reader of the run's canonical
    streams (`neobert.data.stream_layout`): `streams` of them (default: data.streams, or one per reader).
    `start_states` maps stream ids to saved states; `rotation` shifts the worker -> reader map.
    `schedule` gives the micro-batch size and masking rate of each optimizer step (default: `micro_batch_size`
    and `masking.rate` throughout).
    """

    def __init__(self, data, masking, tokenizer, micro_batch_size: int, rank: int = 0, world_size: int = 1,
                 start_states: dict | None = None, rotation: int = 0, skip_docs: int = 0,
                 schedule: DataSchedule | None = None, streams: int = 0):
        super().__init__()
        self.data, self.micro_batch_size = data, micro_batch_size
        self.schedule = schedule or DataSchedule(micro_batch_size, world_size=world_size, mask_rate=masking.rate)
        self.rank, self.world_size = rank, world_size
        self.start_states = start_states or {}
        self.rotation, self.skip_docs = rotation, skip_docs
        self.sources = mixture_sources(data)  # data.source as a mixture of one, or data.sources
        self._held_out: dict[int, frozenset[bytes]] = {}  # per source: digests of its skip_docs held-out documents
        self.masker = MLMMasker.for_pretraining(tokenizer, masking, data, self.schedule.micro_batch_size)
        self.special_ids = set(tokenizer.all_special_ids)
        self.tokenizers = [DocumentTokenizer(tokenizer, text_column(source.data)) for source in self.sources]
        self.workers = max(1, data.num_workers)
        readers = world_size * self.workers
        self.layout = StreamLayout(streams or data.streams or readers, world_size, self.workers)
        problem = self.layout.problem()
        if problem:
            raise ConfigError(f"invalid config key 'data.streams': {problem}")

    @property
    def num_streams(self) -> int:
        return self.layout.streams

    def reader(self) -> int:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        return self.layout.reader(self.rank, (worker + self.rotation) % self.workers)

    def __iter__(self) -> Iterator[dict]:
        """This reader's streams' batches in the run's order of micro-batches (each stream's next one is
        `layout.global_index(stream, batches made)`)."""
        streams = self.layout.streams_of(self.reader())
        batches = {stream: self.stream_batches(stream) for stream in streams}
        made = {stream: self.start_states.get(stream, {}).get("batches", 0) for stream in streams}
        while True:
            stream = min(streams, key=lambda s: self.layout.global_index(s, made[s]))
            made[stream] += 1
            batch = next(batches[stream], None)
            if batch is None:  # the stream's sources are spent
                return
            yield batch

    def stream_batches(self, stream: int) -> Iterator[dict]:
        """Stream `stream`'s batches, from its start state."""
        start = self.start_states.get(stream)
        state = StreamState() if start is None else StreamState.from_dict(copy.deepcopy(start))
        builder = BatchBuilder(self.masker, self.data.max_length, self.data.packing, self.special_ids,
                               self.data.packing_open_rows, unpad=self.data.unpad)
        if state.builder is not None:
            builder.load(state.builder)
        mixture = len(self.sources) > 1
        if mixture and state.mixture is None:
            state.mixture = MixtureState.fresh(len(self.sources))
        documents = self.mixed(stream, state.mixture) if mixture else self.documents(stream, state.position)
        drawn = list(state.mixture.tokens) if mixture else []  # per source, at the previous batch
        if self.data.length_buckets:
            documents = bucketed_documents(documents, state, self.data, stream, self.num_streams)
        for ids in documents:
            builder.add(ids)
            while True:
                step = self.schedule.step_of(self.layout.global_index(stream, state.batches))
                if not builder.ready(self.schedule.batch_size(step)):
                    break
                generator = torch.Generator().manual_seed(derived_seed(self.data.seed, stream, state.batches))
                batch, stats = builder.pop(self.schedule.batch_size(step), generator, self.schedule.mask_rate(step))
                if mixture:  # tokens drawn from each source since this stream's previous batch
                    tokens = state.mixture.tokens
                    stats["source_tokens"] = {s.name: now - before
                                              for s, now, before in zip(self.sources, tokens, drawn)}
                    drawn = list(tokens)
                state.batches, state.builder = state.batches + 1, builder.state()  # the builder's as of this batch
                # Pickled now: a snapshot (no deep copy needed), and one leaf for everything the batch goes through.
                encoded = EncodedStreamState(state)
                batch[DATA_STATE_KEY] = {"stream": stream, "state": encoded, "stats": stats}
                yield batch

    def source(self, stream: int, epoch: int, index: int = 0):
        """Source `index`'s documents for `stream` in `epoch`, its held-out documents left out."""
        data = self.sources[index].data
        dataset = open_source(data)
        if self.skip_docs and self.num_streams == 1:
            dataset = dataset.skip(self.skip_docs)
        elif self.skip_docs:
            # Split over streams, `datasets` would skip 1/streams of the held-out count in each stream's own shards
            # (measured: 37 of 50 held-out documents trained on at 4 streams): drop them by content instead.
            if index not in self._held_out:
                self._held_out[index] = held_out_digests(data, self.skip_docs)
            column, held_out = text_column(data), self._held_out[index]
            dataset = dataset.filter(lambda example: document_digest(example[column]) not in held_out)
        if self.num_streams > 1:
            dataset = split_dataset_by_node(dataset, rank=stream, world_size=self.num_streams)
        dataset.set_epoch(epoch)
        return dataset

    def documents(self, stream: int, position: SourcePosition, index: int = 0) -> Iterator[list[int]]:
        """Token ids of this stream's documents of source `index`, block-shuffled, epoch after epoch (until the
        source's max_epochs); updates `position`."""
        block_size, source = self.data.shuffle_buffer, self.sources[index]
        tokenize = self.tokenizers[index]
        mixture = (index,) if len(self.sources) > 1 else ()  # a source's own shuffles (one source: as ever)
        while not (source.max_epochs and position.epoch >= source.max_epochs):
            whole_epoch = position.source is None and position.block == 0 and position.taken == 0
            dataset = self.source(stream, position.epoch, index)
            if position.source is not None:
                dataset.load_state_dict(position.source)
            produced = False
            for block in read_blocks(dataset, block_size, self.data):
                docs = tokenize.usable(block, position.skipped)
                order = list(range(len(docs)))
                seed = derived_seed(self.data.seed, stream, position.epoch, position.block, *mixture)
                random.Random(seed).shuffle(order)
                # Tokenized a chunk at a time in the shuffled order, not the whole block first: the first document
                # of a block waits for TOKENIZE_CHUNK documents, not for data.shuffle_buffer (a stall of the
                # worker, and of every GPU waiting for its batch, at each block start).
                pending = order[position.taken:]
                for start in range(0, len(pending), TOKENIZE_CHUNK):
                    for ids in tokenize.encode([docs[i] for i in pending[start:start + TOKENIZE_CHUNK]]):
                        position.taken += 1
                        produced = True
                        yield ids
                position.source, position.block, position.taken = dataset.state_dict(), position.block + 1, 0
            if not produced and whole_epoch:  # a whole epoch without a document: the next would be the same
                detail = (f"stream {stream} of data.streams={self.num_streams} got none: use fewer streams (and "
                          f"workers or devices) for a small corpus" if self.num_streams > 1 else "")
                raise no_usable_documents(source.data, position.skipped, self.skip_docs, detail)
            position.epoch, position.source, position.block, position.taken = position.epoch + 1, None, 0, 0

    def mixed(self, stream: int, mix: MixtureState) -> Iterator[list[int]]:
        """The mixture's documents (`neobert.data.mixture.mixed_documents`) from this stream's documents of each
        source (`mix.sources`, the position in each)."""
        sources = [self.documents(stream, mix.sources[i], i) for i in range(len(self.sources))]
        return mixed_documents(sources, mix, self.sources, self.data, stream)


# ---------------------------------------------------------------------------------------------- DataModule
class PretrainingDataModule(L.LightningDataModule):
    """`trainer`: the run's trainer section when its batch-size warm-up or accumulation shapes the stream
    (`DataSchedule.from_config`); None = `micro_batch_size` batches throughout."""

    def __init__(self, data, masking, tokenizer, micro_batch_size: int, trainer=None, phase: str = "",
                 first_step: int = 0):
        """`phase`, `first_step`: the phase of a phased recipe this run is, and its first optimizer step."""
        super().__init__()
        self.data, self.masking, self.tokenizer = data, masking, tokenizer
        self.phase, self.first_step = phase, first_step
        self.sources = mixture_sources(data)  # resolved once (temperature sampling measures the sources' sizes)
        self.micro_batch_size, self.trainer_config = micro_batch_size, trainer
        self.rank, self.world_size = 0, 1
        # global stream id -> its state after its latest trained batch, decoded only for a checkpoint or a restart
        self.stream_states: dict[int, EncodedStreamState] = {}
        self.trained_batches = 0  # on this rank
        self.saved_streams = 0  # data.streams of the checkpoint resumed (0: none)
        self.validation_batches: list[dict] = []

    def check_source(self) -> None:
        """Fails fast on a config pointing at nothing (missing files, hub unreachable) and on a local corpus
        without a usable training document (a DataError counting the empty and undecodable ones)."""
        if self.data.pretokenized_dir:
            local_data_files(str(Path(self.data.pretokenized_dir) / "*.parquet"), "data.pretokenized_dir")
            check_has_documents(self.data, held_out=self.data.validation_docs)
            return
        for source in self.sources:
            if local_data_files(source.data.source, source_key(source.data)) is None:
                require_hub(source.data.source, source_key(source.data))
            else:
                check_has_documents(source.data, held_out=self.data.validation_docs)

    def setup(self, stage: str | None = None) -> None:
        if self.trainer is not None:
            self.rank, self.world_size = self.trainer.global_rank, self.trainer.world_size
        if self.data.validation_docs and not self.validation_batches:
            sources = self.sources
            for source in sources:  # the first data.validation_docs documents of each source
                batches = validation_batches(source.data, self.masking, self.tokenizer, self.micro_batch_size)
                if len(sources) > 1:
                    for batch in batches:
                        batch[SOURCE_KEY] = source.name  # val/loss/<source>
                self.validation_batches += self.deal(batches, source.name)

    def deal(self, batches: list[dict], source: str = "") -> list[dict]:
        """This rank's share of the validation batches (of one source), the same number on every rank (under FSDP2
        every forward is a collective): the remainder is dropped; data.validation_batches caps each rank's share."""
        of_source = f" of source {source!r}" if source else ""
        per_rank, remainder = divmod(len(batches), self.world_size)
        if per_rank == 0:
            raise DataError(f"data.validation_docs={self.data.validation_docs} gives {len(batches)} validation "
                            f"batch(es){of_source}, fewer than the {self.world_size} ranks (every rank needs one): "
                            f"raise data.validation_docs")
        if remainder and self.rank == 0 and not 0 < self.data.validation_batches < per_rank:
            log.info("validation: the last %d of %d batches%s are dropped so that each of the %d ranks validates "
                     "%d (ranks validate in step)", remainder, len(batches), of_source, self.world_size, per_rank)
        if self.data.validation_batches:
            per_rank = min(per_rank, self.data.validation_batches)
        return batches[self.rank : per_rank * self.world_size : self.world_size]

    def source_counts(self) -> dict[str, dict[str, int]]:
        """Per source of a mixture: the documents drawn in this phase and the tokens drawn so far (in the phases
        before too, of the sources it shares with them) by this rank's streams (their trained positions),
        {"documents": {name: n}, "tokens": {name: n}}."""
        sources = self.sources if self.data.sources else []
        totals = {key: {source.name: 0 for source in sources} for key in ("documents", "tokens")}
        mine = {k: v for k, v in self.stream_states.items() if k % self.world_size == self.rank}  # this rank's readers
        for state in mine.values():  # the counts kept beside each encoded state: nothing decoded
            for key, by_source in totals.items():
                for source, count in zip(sources, state.drawn[key]):
                    by_source[source.name] += count
            for source, count in zip(sources, state.drawn["tokens_before"]):
                totals["tokens"][source.name] += count
        return totals

    def layout(self) -> StreamLayout:
        """data.streams (0: the checkpoint's, else one per reader of the run that starts) and this run's readers."""
        workers = max(1, self.data.num_workers)
        streams = self.data.streams or self.saved_streams or self.world_size * workers
        return StreamLayout(streams, self.world_size, workers)

    def batches_per_step(self) -> int:
        """Micro-batches per optimizer step, all ranks together."""
        accumulate = self.trainer_config.accumulate_grad_batches if self.trainer_config is not None else 1
        return accumulate * self.world_size

    def train_stream(self) -> PretrainingStream:
        layout, schedule = self.layout(), None
        if self.trainer_config is not None:
            schedule = DataSchedule.from_config(self.trainer_config, self.masking, self.data.max_length,
                                                self.world_size, first_step=self.first_step)
        start_states = {stream: state.decode() for stream, state in self.stream_states.items()}
        return PretrainingStream(self.data, self.masking, self.tokenizer, self.micro_batch_size, self.rank,
                                 self.world_size, start_states, rotation=self.trained_batches % layout.workers,
                                 skip_docs=self.data.validation_docs, schedule=schedule, streams=layout.streams)

    def train_dataloader(self) -> DataLoader:
        workers = self.data.num_workers
        return DataLoader(self.train_stream(), batch_size=None, num_workers=workers,
                          persistent_workers=workers > 0, pin_memory=torch.cuda.is_available(),
                          prefetch_factor=4 if workers else None)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.validation_batches, batch_size=None, shuffle=False)

    # The data position, saved in every Lightning checkpoint.
    def record(self, data_state: dict) -> None:
        """Called by the LightningModule for every batch it trains on."""
        self.stream_states[data_state["stream"]] = data_state["state"]
        self.trained_batches += 1

    def state_dict(self) -> dict:
        """Every stream's position after its latest trained batch, each rank's micro-batches, the batch layout."""
        per_rank = [{"streams": self.stream_states, "trained_batches": self.trained_batches}]
        if torch.distributed.is_available() and torch.distributed.is_initialized() and self.world_size > 1:
            per_rank = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(
                per_rank, {"streams": self.stream_states, "trained_batches": self.trained_batches})
        streams = {k: v.decode() for part in per_rank for k, v in part["streams"].items()}  # plain, as ever
        return {"streams": streams, "trained_batches": [p["trained_batches"] for p in per_rank],
                "num_streams": self.layout().streams, "batches_per_step": self.batches_per_step(),
                "micro_batch_size": self.micro_batch_size, "phase": self.phase,
                "sources": [source_identity(s.data) for s in self.sources]}

    def check_resume(self, state: dict) -> StreamLayout:
        """This run's layout for a checkpoint's data position: a ConfigError if it cannot go on exactly there
        (`resume_problem`), a CheckpointError if the streams are not where its trained micro-batches leave them. The
        pretraining job asks before the Trainer starts, so nothing is written."""
        self.saved_streams = state["num_streams"]
        layout, same_phase = self.layout(), state.get("phase", "") == self.phase
        problem = resume_problem(state, layout, self.batches_per_step(), self.micro_batch_size, same_phase)
        if problem:
            raise ConfigError(f"resume: {problem}")
        made = {int(k): v["batches"] for k, v in self.saved_stream_states(state, layout).items()}
        problem = layout.position_problem(made, sum(state["trained_batches"])) if same_phase else None
        if problem:
            raise CheckpointError(f"the checkpoint's data position is inconsistent: {problem}")
        return layout

    @staticmethod
    def saved_stream_states(state: dict, layout: StreamLayout) -> dict:
        """The checkpoint's stream states by today's stream numbers."""
        streams = {int(k): v for k, v in state["streams"].items()}
        return streams if "batches_per_step" in state else legacy_streams(streams, layout)

    def load_state_dict(self, state: dict) -> None:
        """Resumes at the next micro-batch of the run on this run's layout."""
        if self.trainer is not None:
            self.rank, self.world_size = self.trainer.global_rank, self.trainer.world_size
        layout = self.check_resume(state)
        streams = {k: StreamState.from_dict(v) for k, v in self.saved_stream_states(state, layout).items()}
        if state.get("phase", "") != self.phase:  # the checkpoint ends the phase before: a new phase starts
            saved = [tuple(identity) for identity in state.get("sources", [])]
            now = [source_identity(s.data) for s in self.sources]
            self.stream_states = {k: EncodedStreamState(carried_state(v, saved, now)) for k, v in streams.items()}
            self.trained_batches = 0  # the streams count this phase's batches from 0 (DataSchedule.first_step)
            log.info("phase %r: the data position of every source it shares with the phase before carries over "
                     "(%d of %d sources)", self.phase, len(set(saved) & set(now)), len(now))
            return
        self.stream_states = {k: EncodedStreamState(v) for k, v in streams.items()}
        # Every rank trained as many micro-batches (one optimizer step is as many on each): this rank's share.
        self.trained_batches = sum(state["trained_batches"]) // self.world_size


def validation_batches(data, masking, tokenizer, micro_batch_size: int) -> list[dict]:
    """The first `data.validation_docs` documents (held out of training), masked once with a fixed seed at the
    fixed `masking.rate` (whatever the training schedule), so every validation loss is computed on the same
    inputs."""
    masker = MLMMasker.for_pretraining(tokenizer, masking, data, micro_batch_size)
    builder = BatchBuilder(masker, data.max_length, data.packing, set(tokenizer.all_special_ids),
                           data.packing_open_rows)
    tokenize, skipped = DocumentTokenizer(tokenizer, text_column(data)), {}
    generator = torch.Generator().manual_seed(derived_seed(data.seed, 999))
    documents = (ids for block in read_blocks(open_source(data).take(data.validation_docs), 1000, data)
                 for ids in tokenize(block, skipped))
    return [batch for batch, _ in builder.all_batches(documents, micro_batch_size, generator)]
