"""Encoder throughput (tokens/s) against sequence length: paper Figure 3 and Table 9, any machine.

Our NeoBERT and the Hugging Face implementations of BERT-base, RoBERTa-base and ModernBERT-base (random init
from their config classes, nothing downloaded), plus the official NeoBERT hub code when it can be imported,
are timed side by side in one run:

* per (model, length), the batch size is searched: the largest candidate that fits (a token budget on CPU, an
  out-of-memory probe on GPU), then the fastest of the largest few that fit;
* repetitions are interleaved across models (A, B, C, A, B, C, ...) and the median is reported, so a shared or
  throttling machine slows every model alike and the ratios stay fair;
* layouts: ``full`` (every sequence exactly `length` tokens), ``padded`` (a realistic spread of document
  lengths padded to `length`) and ``unpadded`` (the same documents with no pad tokens: our packed varlen path;
  ModernBERT's flash-attention unpadding on GPU only). Only real tokens count towards tokens/s;
* FLOPs/token come from :mod:`neobert.eval.flops` for every model, giving achieved FLOP/s (and MFU on GPU).
"""

from __future__ import annotations

import csv
import dataclasses
import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import torch
from torch import Tensor, nn

from neobert.eval.flops import PEAK_FLOPS, flops_per_token, matmul_params

log = logging.getLogger(__name__)

MODEL_NAMES = ("neobert", "neobert-official", "bert-base", "roberta-base", "modernbert-base")
LAYOUTS = ("full", "padded", "unpadded")
MODES = ("inference", "training")
OFFICIAL_HUB_NAME = "chandar-lab/NeoBERT"


@dataclass
class ThroughputConfig:
    """`python -m experiments.throughput key=value ...`; empty lists take device-dependent defaults."""

    models: List[str] = field(default_factory=lambda: ["neobert", "neobert-official", "bert-base", "roberta-base",
                                                       "modernbert-base"])
    lengths: List[int] = field(default_factory=list)  # CPU: 128, 512; GPU: 128 ... 4096
    layouts: List[str] = field(default_factory=lambda: ["full"])
    mode: str = "inference"  # inference | training (forward + backward, no optimizer update)
    batch_sizes: List[int] = field(default_factory=list)  # candidates; default powers of two 1 ... 1024
    max_tokens: int = 4096  # CPU memory budget per batch (batch x length); ignored on GPU (OOM probing instead)
    search_top: int = 3  # how many of the largest fitting batch sizes are timed to pick the fastest
    repeats: int = 3  # interleaved timed repetitions per model; the median is reported
    warmup: int = 1
    neobert_preset: str = "neobert"
    official_code_dir: Optional[str] = None  # a local copy of the hub repo chandar-lab/NeoBERT (model.py + config)
    device: str = "auto"  # auto | cpu | cuda
    peak_flops: Optional[float] = None  # for MFU; default from flops.PEAK_FLOPS by GPU name
    threads: int = 0  # torch CPU threads; 0 = leave as is
    seed: int = 0
    output_dir: str = "runs/throughput"

    def validate(self) -> None:
        unknown = sorted(set(self.models) - set(MODEL_NAMES))
        if unknown:
            raise ValueError(f"models: unknown {unknown}; known: {list(MODEL_NAMES)}")
        bad = sorted(set(self.layouts) - set(LAYOUTS))
        if bad:
            raise ValueError(f"layouts: unknown {bad}; known: {list(LAYOUTS)}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if any(n <= 0 for n in self.lengths) or any(b <= 0 for b in self.batch_sizes):
            raise ValueError("lengths and batch_sizes must be positive integers")
        if self.repeats < 1 or self.search_top < 1:
            raise ValueError("repeats and search_top must be at least 1")


# ---------------------------------------------------------------------------------------------- models
@dataclass
class BenchModel:
    """One encoder under test. `run(batch)` performs one forward (or training) step on a prepared batch."""

    name: str
    module: nn.Module
    num_layers: int
    hidden_size: int
    max_length: int
    vocab_size: int
    pad_token_id: int
    supports_unpadded: bool
    forward: Callable[[nn.Module, "Batch"], Tensor]

    @property
    def matmul_weights(self) -> int:
        return matmul_params(self.module)

    def flops_per_token(self, seq_len: int, training: bool) -> float:
        return flops_per_token(self.matmul_weights, self.num_layers, self.hidden_size, seq_len, training)


class ModelUnavailable(RuntimeError):
    """The model cannot be built on this machine (e.g. the official code cannot be imported)."""


def _neobert_forward(module: nn.Module, batch: "Batch") -> Tensor:
    if batch.cu_seqlens is not None:  # our packed varlen path: pad tokens are never computed
        return module(batch.input_ids, cu_seqlens=batch.cu_seqlens, max_seqlen=batch.max_seqlen).last_hidden_state
    return module(batch.input_ids, batch.attention_mask).last_hidden_state


def _hf_forward(module: nn.Module, batch: "Batch") -> Tensor:
    if batch.cu_seqlens is not None:
        # transformers' packed form (flash_attention_2 only): one row of documents, positions restart per doc.
        return module(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None]).last_hidden_state
    return module(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state


def _hf_config(name: str):
    from transformers import BertConfig, ModernBertConfig, RobertaConfig

    if name == "bert-base":
        return BertConfig()  # the defaults are bert-base-uncased: 12 x 768, 30,522 tokens, 512 positions
    if name == "roberta-base":
        return RobertaConfig(vocab_size=50265, max_position_embeddings=514, type_vocab_size=1, pad_token_id=1,
                             bos_token_id=0, eos_token_id=2, layer_norm_eps=1e-5)
    return ModernBertConfig()  # the defaults are ModernBERT-base: 22 x 768, 8,192 positions


def _hf_max_length(name: str, config) -> int:
    # RoBERTa's positions start after the padding index: 514 embeddings hold 512 tokens.
    return config.max_position_embeddings - (2 if name == "roberta-base" else 0)


def build_model(name: str, device: torch.device, dtype: torch.dtype, neobert_preset: str = "neobert",
                official_code_dir: str | None = None) -> BenchModel:
    """A randomly initialised encoder (no download). Raises ModelUnavailable with the reason when it cannot."""
    if name == "neobert":
        from neobert.model import NeoBERT, NeoBERTConfig

        config = NeoBERTConfig.from_preset(neobert_preset)
        module = NeoBERT(config)
        bench = BenchModel(name, module, config.num_hidden_layers, config.hidden_size, config.max_length,
                           config.vocab_size, config.pad_token_id, True, _neobert_forward)
    elif name == "neobert-official":
        bench = _build_official(official_code_dir)
    else:
        from transformers import AutoModel

        config = _hf_config(name)
        attn = "sdpa"
        if device.type == "cuda" and name == "modernbert-base" and _has_flash_attn():
            attn = "flash_attention_2"  # ModernBERT's unpadding path
        module = AutoModel.from_config(config, attn_implementation=attn)
        bench = BenchModel(name, module, config.num_hidden_layers, config.hidden_size, _hf_max_length(name, config),
                           config.vocab_size, config.pad_token_id, attn == "flash_attention_2", _hf_forward)
    bench.module.to(device=device, dtype=dtype)
    return bench


def _has_flash_attn() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def _build_official(code_dir: str | None) -> BenchModel:
    """The hub's own modeling file (trust_remote_code), from `official_code_dir` or the local hub cache."""
    from transformers import AutoConfig, AutoModel

    if code_dir is None:
        try:
            from huggingface_hub import snapshot_download

            code_dir = snapshot_download(OFFICIAL_HUB_NAME, local_files_only=True, allow_patterns=["*.py", "*.json"])
        except Exception as err:  # not in the local cache; downloading is not this benchmark's job
            raise ModelUnavailable(
                f"the official code ({OFFICIAL_HUB_NAME}) is not in the local hub cache; set official_code_dir "
                f"to a copy of the hub repository ({type(err).__name__})"
            ) from err
    if not (Path(code_dir) / "model.py").is_file():
        raise ModelUnavailable(f"official_code_dir={code_dir!r} has no model.py (the hub modeling file)")
    try:
        config = AutoConfig.from_pretrained(code_dir, trust_remote_code=True)
        module = AutoModel.from_config(config, trust_remote_code=True)
    except Exception as err:  # e.g. its hard xFormers import on a CPU machine
        raise ModelUnavailable(f"the official modeling code cannot be imported: {type(err).__name__}: {err}") from err
    return BenchModel("neobert-official", module, config.num_hidden_layers, config.hidden_size, config.max_length,
                      config.vocab_size, config.pad_token_id, False, _hf_forward)


# ---------------------------------------------------------------------------------------------- batches
@dataclass
class Batch:
    input_ids: Tensor  # [B, L] padded, or [T] packed
    attention_mask: Tensor | None
    real_tokens: int
    cu_seqlens: Tensor | None = None
    max_seqlen: int | None = None
    position_ids: Tensor | None = None


def document_lengths(batch_size: int, length: int, generator: torch.Generator) -> list[int]:
    """A realistic spread of document lengths for padded batches: uniform in [length/8, length], with one
    document of the full length so that the padded width is `length` (as a length-sorted loader would give)."""
    low = max(1, length // 8)
    lengths = torch.randint(low, length + 1, (batch_size,), generator=generator).tolist()
    lengths[0] = length
    return lengths


def make_batch(batch_size: int, length: int, layout: str, vocab_size: int, pad_token_id: int,
               device: torch.device, seed: int = 0) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    if layout == "full":
        lengths = [length] * batch_size
    else:
        lengths = document_lengths(batch_size, length, generator)
    ids = torch.randint(0, vocab_size, (batch_size, length), generator=generator)
    ids[ids == pad_token_id] = (pad_token_id + 1) % vocab_size  # pad ids only where padding is
    mask = (torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]).long()
    real = int(mask.sum())
    if layout == "unpadded":
        lens = torch.tensor(lengths, dtype=torch.int32)
        cu = torch.nn.functional.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
        positions = torch.cat([torch.arange(n) for n in lengths])
        return Batch(ids[mask.bool()].to(device), None, real, cu.to(device), max(lengths), positions.to(device))
    ids = ids.masked_fill(mask == 0, pad_token_id)
    return Batch(ids.to(device), mask.to(device) if layout == "padded" else None, real)


# ---------------------------------------------------------------------------------------------- timing
def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(model: BenchModel, batch: Batch, training: bool, device: torch.device) -> float:
    """Seconds for one inference forward, or one training step (forward + backward of a scalar loss)."""
    _synchronize(device)
    start = time.perf_counter()
    if training:
        model.module.train()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            hidden = model.forward(model.module, batch)
        hidden.float().square().mean().backward()
        model.module.zero_grad(set_to_none=True)
    else:
        model.module.eval()
        with torch.inference_mode():
            model.forward(model.module, batch)
    _synchronize(device)
    return time.perf_counter() - start


def is_out_of_memory(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def search_batch_size(candidates: Sequence[int], fits: Callable[[int], bool],
                      throughput: Callable[[int], float], top: int = 3) -> tuple[int | None, int | None, dict]:
    """Returns (fastest batch size, largest that fits, {batch size: tokens/s}).

    `fits` is probed from the smallest candidate up and the search stops at the first that does not fit
    (memory grows with the batch); then the `top` largest fitting sizes are timed and the fastest wins."""
    fitting = []
    for size in sorted(set(candidates)):
        if not fits(size):
            break
        fitting.append(size)
    if not fitting:
        return None, None, {}
    speeds = {size: throughput(size) for size in fitting[-top:]}
    best = max(speeds, key=lambda size: speeds[size])
    return best, fitting[-1], speeds


# ---------------------------------------------------------------------------------------------- runner
@dataclass
class ThroughputRow:
    model: str
    mode: str
    layout: str
    seq_len: int
    batch_size: int | None
    tokens_per_s: float | None
    step_s: float | None
    flops_per_token: float | None
    achieved_flops: float | None
    mfu: float | None
    params: int | None
    device: str
    dtype: str
    note: str = ""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but no CUDA device is available")
    return torch.device(name)


def default_lengths(device: torch.device) -> list[int]:
    return [128, 256, 512, 1024, 2048, 4096] if device.type == "cuda" else [128, 512]


def default_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    return next((peak for key, peak in PEAK_FLOPS.items() if key in name), None)


def run_throughput(config: ThroughputConfig, progress: Callable[[str], None] = log.info) -> list[ThroughputRow]:
    config.validate()
    if config.threads:
        torch.set_num_threads(config.threads)
    device = resolve_device(config.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    training = config.mode == "training"
    lengths = config.lengths or default_lengths(device)
    candidates = config.batch_sizes or [2 ** i for i in range(11)]
    peak = config.peak_flops or default_peak_flops(device)

    models: dict[str, BenchModel] = {}
    rows: list[ThroughputRow] = []

    def unavailable(name: str, layout: str, length: int | None, note: str, bench: BenchModel | None = None):
        params = None if bench is None else sum(p.numel() for p in bench.module.parameters())
        rows.append(ThroughputRow(name, config.mode, layout, length or 0, None, None, None, None, None, None, params,
                                  device.type, str(dtype).removeprefix("torch."), note))

    torch.manual_seed(config.seed)
    for name in config.models:
        try:
            models[name] = build_model(name, device, dtype, config.neobert_preset, config.official_code_dir)
        except ModelUnavailable as err:
            progress(f"{name}: not available: {err}")
            for layout in config.layouts:
                for length in lengths:
                    unavailable(name, layout, length, f"not available: {err}")

    for layout in config.layouts:
        for length in lengths:
            chosen: dict[str, tuple[int, Batch]] = {}
            for name, bench in models.items():
                if length > bench.max_length:
                    unavailable(name, layout, length, f"max length {bench.max_length}", bench)
                    continue
                if layout == "unpadded" and not bench.supports_unpadded:
                    unavailable(name, layout, length, "no unpadded path on this machine", bench)
                    continue
                best = _search(bench, layout, length, candidates, config, device, training)
                if best is None:
                    unavailable(name, layout, length, "no candidate batch size fits", bench)
                    continue
                chosen[name] = best
                progress(f"{layout} L={length} {name}: batch size {best[0]}")
            # Interleaved, timed repetitions: A, B, C, A, B, C, ...
            times: dict[str, list[float]] = {name: [] for name in chosen}
            for _ in range(config.repeats):
                for name, (size, batch) in chosen.items():
                    times[name].append(time_step(models[name], batch, training, device))
            for name, (size, batch) in chosen.items():
                bench = models[name]
                step = statistics.median(times[name])
                tokens_per_s = batch.real_tokens / step
                fpt = bench.flops_per_token(length, training)
                achieved = tokens_per_s * fpt
                rows.append(ThroughputRow(
                    name, config.mode, layout, length, size, tokens_per_s, step, fpt, achieved,
                    None if peak is None else achieved / peak, sum(p.numel() for p in bench.module.parameters()),
                    device.type, str(dtype).removeprefix("torch."),
                ))
                progress(f"{layout} L={length} {name}: {tokens_per_s:,.0f} tokens/s (batch {size})")
    return rows


def _search(bench: BenchModel, layout: str, length: int, candidates: Sequence[int], config: ThroughputConfig,
            device: torch.device, training: bool) -> tuple[int, Batch] | None:
    batches: dict[int, Batch] = {}

    def batch_of(size: int) -> Batch:
        if size not in batches:
            batches[size] = make_batch(size, length, layout, bench.vocab_size, bench.pad_token_id, device, config.seed)
        return batches[size]

    def fits(size: int) -> bool:
        if device.type != "cuda":
            return config.max_tokens <= 0 or size * length <= config.max_tokens
        try:
            time_step(bench, batch_of(size), training, device)
            return True
        except (torch.OutOfMemoryError, RuntimeError) as err:
            if not is_out_of_memory(err):
                raise
            batches.pop(size, None)
            torch.cuda.empty_cache()
            return False

    def throughput(size: int) -> float:
        batch = batch_of(size)
        for _ in range(config.warmup):
            time_step(bench, batch, training, device)
        return batch.real_tokens / time_step(bench, batch, training, device)

    if len(set(candidates)) == 1:  # a batch size the user fixed: no search and no CPU budget, just warm up
        size = candidates[0]
        if device.type == "cuda" and not fits(size):
            return None
        for _ in range(config.warmup):
            time_step(bench, batch_of(size), training, device)
        return size, batch_of(size)
    best, _, _ = search_batch_size(candidates, fits, throughput, config.search_top)
    if best is None:
        return None
    for size in list(batches):
        if size != best:
            del batches[size]
    return best, batch_of(best)


# ---------------------------------------------------------------------------------------------- reports
CSV_FIELDS = [f.name for f in dataclasses.fields(ThroughputRow)]


def write_csv(rows: Sequence[ThroughputRow], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow(dataclasses.asdict(row))
    return path


def read_csv(path: str | Path) -> list[ThroughputRow]:
    """Reads a CSV written by `write_csv` (for the notebook and for re-plotting)."""
    types = {"batch_size": int, "seq_len": int, "params": int, "tokens_per_s": float, "step_s": float,
             "flops_per_token": float, "achieved_flops": float, "mfu": float}
    rows = []
    with Path(path).open() as handle:
        for raw in csv.DictReader(handle):
            values = {k: (types[k](v) if v not in ("", None) else None) if k in types else v for k, v in raw.items()}
            rows.append(ThroughputRow(**values))
    return rows


def _fmt(value: float | None, scale: float = 1.0, digits: int = 0) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value / scale:,.{digits}f}"


def markdown_table(rows: Sequence[ThroughputRow], reference: str = "neobert") -> str:
    """Table 9 layout per (mode, layout): models as rows, lengths as columns, tokens/s (batch size); then the
    achieved FLOP/s, and the ratio of `reference` to every other model per length."""
    out = []
    groups = sorted({(r.mode, r.layout) for r in rows}, key=lambda g: (MODES.index(g[0]), LAYOUTS.index(g[1])))
    for mode, layout in groups:
        group = [r for r in rows if (r.mode, r.layout) == (mode, layout)]
        lengths = sorted({r.seq_len for r in group if r.seq_len})
        names = [n for n in MODEL_NAMES if any(r.model == n for r in group)]
        cell = {(r.model, r.seq_len): r for r in group}
        notes = {r.model: r.note for r in group if r.note.startswith("not available")}
        header = "| model | " + " | ".join(str(n) for n in lengths) + " |"
        rule = "|---|" + "---:|" * len(lengths)

        def section(title: str, models: Sequence[str], text: Callable[[str, int], str], label=lambda n: n) -> None:
            out.extend([f"### {mode}, {layout} batches: {title}\n", header, rule])
            for name in models:
                out.append(f"| {label(name)} | " + " | ".join(text(name, length) for length in lengths) + " |")
            out.append("")

        def measured(model: str, length: int) -> bool:
            return cell.get((model, length)) is not None and cell[(model, length)].tokens_per_s is not None

        def tokens_per_s(name: str, length: int) -> str:
            row = cell.get((name, length))
            return f"{row.tokens_per_s:,.0f} ({row.batch_size})" if measured(name, length) else "n/a"

        has_mfu = any(r.mfu is not None for r in group)

        def rate(name: str, length: int) -> str:
            row = cell.get((name, length))
            value = None if row is None else (row.mfu * 100 if has_mfu and row.mfu is not None else
                                              None if row.achieved_flops is None else row.achieved_flops / 1e9)
            return _fmt(value, digits=1)

        def ratio(name: str, length: int) -> str:
            if not (measured(name, length) and measured(reference, length)):
                return "n/a"
            ours, theirs = cell[(reference, length)], cell[(name, length)]
            speed = ours.tokens_per_s / theirs.tokens_per_s
            per_flop = ours.achieved_flops / theirs.achieved_flops
            return f"{speed:.2f}x; {per_flop:.2f}x"

        section("tokens/s (best batch size)", names, tokens_per_s)
        unit = "MFU %" if has_mfu else "achieved GFLOP/s"
        section(f"{unit} (tokens/s x FLOPs/token from neobert.eval.flops)", names, rate)
        others = [n for n in names if n != reference and any(measured(n, x) and measured(reference, x)
                                                             for x in lengths)]
        if others:
            section(f"ratio {reference} / other (tokens/s; per FLOP)", others, ratio,
                    label=lambda n: f"{reference} / {n}")
        for name, note in notes.items():
            out.append(f"- {name}: {note}")
        if notes:
            out.append("")
    return "\n".join(out)


def write_reports(rows: Sequence[ThroughputRow], output_dir: str | Path) -> dict[str, Path]:
    """CSV, Markdown table and the Figure 3 plot under `output_dir`."""
    from neobert.eval.plots import plot_throughput

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = {"csv": write_csv(rows, output_dir / "throughput.csv")}
    paths["markdown"] = output_dir / "throughput.md"
    paths["markdown"].write_text(markdown_table(rows) + "\n")
    paths["plot"] = plot_throughput(rows, output_dir / "throughput.png")
    return paths
