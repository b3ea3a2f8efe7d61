"""Data-pipeline throughput: tokens/s of one worker for tokenize + mask (+ pack), this suite's pipeline
against Hugging Face's `DataCollatorForLanguageModeling` doing the same work on the same documents in the
same process (`python -m experiments.bench_data`; figures in docs/benchmarks.md).

Both sides start from raw text and end with masked, padded (multiple of 8) int64 batches: ours through
`PretrainingStream`'s parts (DocumentTokenizer -> BatchBuilder -> MLMMasker), Hugging Face's through
`tokenizer(..., truncation=True)` -> `DataCollatorForLanguageModeling(mlm_probability=0.2,
mask_replace_prob=1.0, random_replace_prob=0.0, pad_to_multiple_of=8)`. Tokens counted are real (non-pad)
tokens of the batches produced. The corpus is the demo's (CPython documentation), cycled to `docs`.

`measure_stream`: one reader's whole `PretrainingStream` as the trainer's DataLoader gets it (source reading, block
shuffle, tokenizing, batching, masking and the state each batch carries): documents/s and host time per batch, and the
size of the data position a checkpoint then holds for all its `data.streams` streams.
"""

from __future__ import annotations

import itertools
import pickle
import time
from pathlib import Path

import torch
# Imported up front so that no timing includes an import.
from transformers import DataCollatorForLanguageModeling

from neobert.config.pretrain import MaskingConfig, PretrainDataConfig
from neobert.data.corpus import DocumentTokenizer
from neobert.data.demo_corpus import demo_documents
from neobert.data.masking import MLMMasker
from neobert.data.pretraining import BatchBuilder, PretrainingDataModule
from neobert.data.stream_state import DATA_STATE_KEY
from neobert.data.tokenizer import load_tokenizer


def run_ours(texts, tokenizer, data, masking, batch_size: int) -> int:
    masker = MLMMasker.from_tokenizer(tokenizer, masking.rate, masking.strategy, masking.pad_to_multiple_of)
    builder = BatchBuilder(masker, data.max_length, data.packing, set(tokenizer.all_special_ids),
                           data.packing_open_rows)
    tokenize, generator, tokens = DocumentTokenizer(tokenizer, "content"), torch.Generator().manual_seed(0), 0
    for start in range(0, len(texts), 1000):  # blocks, as the stream reads them
        for ids in tokenize({"content": texts[start : start + 1000]}, {}):
            builder.add(ids)
            while builder.ready(batch_size):
                batch = builder.pop(batch_size, generator)[0]
                tokens += int(batch["attention_mask"].sum()) if "attention_mask" in batch else batch["input_ids"].numel()
    return tokens


def run_hf(texts, tokenizer, max_length: int, batch_size: int) -> int:
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.2, mask_replace_prob=1.0,
                                               random_replace_prob=0.0, pad_to_multiple_of=8, return_tensors="pt")
    tokens = 0
    for start in range(0, len(texts), 1000):
        encoded = tokenizer(texts[start : start + 1000], truncation=True, max_length=max_length,
                            return_special_tokens_mask=True)["input_ids"]
        for i in range(0, len(encoded) - batch_size + 1, batch_size):
            batch = collator([{"input_ids": ids} for ids in encoded[i : i + batch_size]])
            tokens += int(batch["attention_mask"].sum())
    return tokens


def best_rate(fn, repeats: int) -> float:
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = fn()
        rates.append(tokens / (time.perf_counter() - start))
    return max(rates)


def measure_data_pipeline(docs: int = 3000, max_length: int = 128, batch_size: int = 32,
                          repeats: int = 3) -> dict[str, float]:
    """Best-of-`repeats` tokens/s of the three pipelines on one thread, and our ratios to Hugging Face's."""
    torch.set_num_threads(1)  # one worker's worth of CPU
    texts = [d["content"] for d in itertools.islice(itertools.cycle(demo_documents()), docs)]
    tokenizer = load_tokenizer()
    masking = MaskingConfig(rate=0.2, strategy="all_mask")
    truncated = PretrainDataConfig(max_length=max_length, packing="none")
    packed = PretrainDataConfig(max_length=max_length, packing="greedy")
    results = {
        "hf_collator_tokens_per_s": best_rate(lambda: run_hf(texts, tokenizer, max_length, batch_size), repeats),
        "ours_truncate_tokens_per_s": best_rate(lambda: run_ours(texts, tokenizer, truncated, masking, batch_size),
                                                repeats),
        "ours_pack_tokens_per_s": best_rate(lambda: run_ours(texts, tokenizer, packed, masking, batch_size), repeats),
    }
    results["ratio_truncate_vs_hf"] = results["ours_truncate_tokens_per_s"] / results["hf_collator_tokens_per_s"]
    results["ratio_pack_vs_hf"] = results["ours_pack_tokens_per_s"] / results["hf_collator_tokens_per_s"]
    return results


def packing_report(docs: int = 3000, max_length: int = 128, batch_size: int = 32,
                   open_rows: int = 64) -> dict[str, dict[str, float]]:
    """What each `data.packing` mode makes of the same documents (the demo corpus cycled to `docs`): packing
    efficiency (real tokens / (rows x max_length), the share of the rows' capacity that holds text), how many
    documents are cut across rows, and how many tokens truncation drops."""
    texts = [d["content"] for d in itertools.islice(itertools.cycle(demo_documents()), docs)]
    tokenizer = load_tokenizer()
    masker = MLMMasker.from_tokenizer(tokenizer)
    documents = [ids for start in range(0, len(texts), 1000)
                 for ids in DocumentTokenizer(tokenizer, "content")({"content": texts[start : start + 1000]}, {})]
    total_tokens = sum(len(ids) for ids in documents)
    report = {}
    for mode in ("none", "greedy", "best_fit"):
        builder = BatchBuilder(masker, max_length, mode, set(tokenizer.all_special_ids), open_rows)
        rows, tokens, segments = 0, 0, 0
        for batch, stats in builder.all_batches(documents, batch_size, torch.Generator().manual_seed(0)):
            rows, tokens = rows + stats["rows"], tokens + stats["tokens"]
            segments += len(batch["cu_seqlens"]) - 1 if "cu_seqlens" in batch else stats["rows"]
        report[mode] = {"packing_efficiency": tokens / (rows * max_length), "rows": rows,
                        "documents_cut": segments - len(documents) if mode != "none" else 0,
                        "tokens_dropped": total_tokens - tokens}
    report["corpus"] = {"documents": len(documents), "tokens": total_tokens,
                        "longer_than_a_row": sum(len(ids) > max_length for ids in documents)}
    return report


def measure_stream(corpus: str | Path, batches: int = 200, max_length: int = 128, batch_size: int = 32,
                   packing: str = "none", streams: int = 0) -> dict[str, float]:
    """`batches` batches of one reader (this process, as with data.num_workers=0) of `data.streams` streams (0: one)
    over the local `corpus`, after a first batch that opens the source; then every stream's position recorded as
    training records it, and the pickled size of the DataModule's state (what each checkpoint holds)."""
    torch.set_num_threads(1)  # one worker's worth of CPU
    fields = dict(source=str(corpus), max_length=max_length, packing=packing, num_workers=0, shuffle_buffer=1000)
    data = PretrainDataConfig(**fields, **({"streams": streams} if streams else {}))  # 0: as before data.streams
    datamodule = PretrainingDataModule(data, MaskingConfig(), load_tokenizer(), batch_size)
    iterator = iter(datamodule.train_stream())
    datamodule.record(next(iterator)[DATA_STATE_KEY])
    documents, tokens, start = 0, 0, time.perf_counter()
    for batch in itertools.islice(iterator, batches):
        datamodule.record(batch[DATA_STATE_KEY])
        documents += len(batch["cu_seqlens"]) - 1 if "cu_seqlens" in batch else batch["input_ids"].shape[0]
        tokens += batch[DATA_STATE_KEY]["stats"]["tokens"]
    seconds = time.perf_counter() - start
    return {"documents_per_s": documents / seconds, "tokens_per_s": tokens / seconds,
            "ms_per_batch": 1000 * seconds / batches, "streams_with_a_position": len(datamodule.stream_states),
            "data_state_bytes": len(pickle.dumps(datamodule.state_dict()))}
