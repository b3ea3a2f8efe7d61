"""How a pretraining run's data is cut up, whatever machines read it: `data.streams` canonical streams, fixed for the
run and recorded in its checkpoints, served by however many readers (ranks x DataLoader workers) there are.

The run's micro-batches form one global sequence g = 0, 1, 2, ...: micro-batch g is the (g // streams)-th batch of
stream g % streams and belongs to optimizer step g // (accumulation x ranks). Rank r trains g = r, r + ranks,
r + 2 ranks, ... in that order, so its k-th micro-batch is g = k x ranks + r, and its DataLoader worker at position p
(the round-robin turn, `PretrainingStream.stream_id`) makes those with k = p mod workers. That worker is reader
p x ranks + r, and when the readers divide the streams its micro-batches are exactly the batches of the streams
congruent to it modulo the readers: it reads those streams, whole and alone, and serves their batches in the order
of g. So which documents, masked how, make which optimizer step depends on the data, the seed, the streams, the
micro-batch size and the micro-batches per step only: 1 device x 8 accumulation and 8 devices x 1 train alike, with
any number of workers, and a checkpoint resumes on any layout whose readers divide the streams
(`resume_problem` says what cannot).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StreamLayout:
    streams: int  # canonical streams (data.streams)
    world_size: int = 1  # data-parallel ranks: devices x nodes
    workers: int = 1  # readers per rank: data.num_workers, at least 1 (0 workers: the rank's process reads)

    @property
    def readers(self) -> int:
        return self.world_size * self.workers

    def reader(self, rank: int, position: int) -> int:
        """The reader of rank `rank`'s DataLoader worker at round-robin position `position`."""
        return position * self.world_size + rank

    def streams_of(self, reader: int) -> list[int]:
        return list(range(reader, self.streams, self.readers))

    def global_index(self, stream: int, batch: int) -> int:
        """The run's micro-batch index of `stream`'s `batch`-th batch (0-based)."""
        return batch * self.streams + stream

    def batches_before(self, stream: int, micro_batches: int) -> int:
        """How many of the run's first `micro_batches` micro-batches are `stream`'s."""
        return max(0, -(-(micro_batches - stream) // self.streams))

    def position_problem(self, made: dict[int, int], micro_batches: int) -> str | None:
        """Why the streams' batch counts `made` are not where `micro_batches` trained micro-batches leave them (a
        data state cut or mixed up, which would train documents twice or skip them), or None."""
        for stream in range(self.streams):
            expected = self.batches_before(stream, micro_batches)
            if made.get(stream, 0) != expected:
                return (f"stream {stream} made {made.get(stream, 0)} batches, {micro_batches} trained "
                        f"micro-batches give it {expected}")
        return None

    def problem(self) -> str | None:
        """Why these readers cannot serve the streams, or None."""
        if self.streams % self.readers == 0:
            return None
        fits = [n for n in range(1, self.streams + 1) if self.streams % n == 0]
        return (f"data.streams={self.streams} cannot be read by {self.world_size} device(s) x {self.workers} "
                f"data.num_workers = {self.readers} readers (each reader takes whole streams): use devices x "
                f"num_nodes x max(1, data.num_workers) in {fits}")


def resume_problem(saved: dict, layout: StreamLayout, batches_per_step: int, micro_batch_size: int,
                   same_phase: bool) -> str | None:
    """Why a checkpoint's data position (`PretrainingDataModule.state_dict`) cannot go on exactly with this layout,
    micro-batches per optimizer step and micro-batch size, or None. A new phase may change the batch (its streams
    count batches from 0); the streams themselves carry across it."""
    if "batches_per_step" not in saved:
        return legacy_problem(saved, layout)
    if saved["num_streams"] != layout.streams:
        return (f"the checkpoint's data is cut into data.streams={saved['num_streams']}, this run asks for "
                f"data.streams={layout.streams}: set data.streams={saved['num_streams']} (or 0, the checkpoint's)")
    if not same_phase:
        return layout.problem()
    if saved["micro_batch_size"] != micro_batch_size:
        return (f"trainer.micro_batch_size={micro_batch_size}, but the checkpoint's batches were cut at "
                f"{saved['micro_batch_size']}: set trainer.micro_batch_size={saved['micro_batch_size']} (a new "
                f"global batch starts a new phase)")
    if saved["batches_per_step"] != batches_per_step:
        accumulate, remainder = divmod(saved["batches_per_step"], layout.world_size)
        advice = (f"set trainer.accumulate_grad_batches={accumulate} on these {layout.world_size} device(s)"
                  if not remainder else f"use a number of devices x num_nodes dividing {saved['batches_per_step']}")
        return (f"the checkpoint's optimizer steps take {saved['batches_per_step']} micro-batches (trainer."
                f"accumulate_grad_batches x devices x num_nodes), this run's {batches_per_step}: the global batch "
                f"would change mid-run; {advice} (a new global batch starts a new phase)")
    return layout.problem()


def legacy_problem(saved: dict, layout: StreamLayout) -> str | None:
    """A checkpoint written before data.streams: its streams were one per reader, and it resumes on its own layout
    only (`legacy_streams` renumbers them)."""
    world_size = len(saved["trained_batches"])
    workers = saved["num_streams"] // world_size
    if (world_size, workers) == (layout.world_size, layout.workers) and layout.streams == saved["num_streams"]:
        return None
    return (f"the checkpoint's data position was written for {world_size} device(s) x {workers} data.num_workers, "
            f"before data.streams existed: resume it with that many devices x num_nodes and workers, and "
            f"data.streams=0")


def legacy_streams(streams: dict, layout: StreamLayout) -> dict:
    """A pre-data.streams checkpoint's streams (numbered rank x workers + position) under today's numbering
    (position x ranks + rank): the same readers, the same batches."""
    renumbered = {}
    for stream, state in streams.items():
        rank, position = divmod(int(stream), layout.workers)
        renumbered[layout.reader(rank, position)] = state
    return renumbered
