"""The data-pipeline benchmark (`python -m experiments.bench_data`; the measurements:
`neobert.instruments.data_pipeline`): tokens/s of one worker for tokenize + mask (+ pack) against Hugging Face's collator (`bench_speed`), or the
packing efficiency of each data.packing mode on the same documents (`bench_packing`), or one reader's whole stream
over a local corpus and the size of its checkpointed position (`bench_stream`). Each prints its table and
writes its results as JSON where asked."""

from __future__ import annotations

import json
from pathlib import Path

from neobert.instruments.data_pipeline import measure_data_pipeline, measure_stream, packing_report


def bench_speed(docs: int, max_length: int, batch_size: int, repeats: int, json_path: str | Path | None = None) -> dict:
    results = measure_data_pipeline(docs, max_length, batch_size, repeats)
    print(f"{'pipeline (1 worker, 1 thread)':44s} tokens/s")
    print(f"{'HF tokenizer + DataCollatorForLanguageModeling':44s} {results['hf_collator_tokens_per_s']:,.0f}")
    print(f"{'ours, truncation':44s} {results['ours_truncate_tokens_per_s']:,.0f} "
          f"({results['ratio_truncate_vs_hf']:.2f}x)")
    print(f"{'ours, packing':44s} {results['ours_pack_tokens_per_s']:,.0f} ({results['ratio_pack_vs_hf']:.2f}x)")
    write_json(results, json_path)
    return results


def bench_packing(docs: int, max_length: int, batch_size: int, open_rows: int,
                  json_path: str | Path | None = None) -> dict:
    report = packing_report(docs, max_length, batch_size, open_rows)
    corpus = report.pop("corpus")
    print(f"{corpus['documents']:,} documents, {corpus['tokens']:,} tokens, {corpus['longer_than_a_row']:,} longer "
          f"than a row of {max_length}")
    print(f"{'data.packing':12s} {'efficiency':>10s} {'rows':>8s} {'documents cut':>14s} {'tokens dropped':>15s}")
    for mode, row in report.items():
        print(f"{mode:12s} {row['packing_efficiency']:10.4f} {row['rows']:8,d} {row['documents_cut']:14,d} "
              f"{row['tokens_dropped']:15,d}")
    report["corpus"] = corpus
    write_json(report, json_path)
    return report


def bench_stream(corpus: str | Path, batches: int, max_length: int, batch_size: int, packing: str, streams: int,
                 json_path: str | Path | None = None) -> dict:
    results = measure_stream(corpus, batches, max_length, batch_size, packing, streams)
    print(f"one reader of data.streams={streams or 1} ({packing}, {batch_size} x {max_length}): "
          f"{results['documents_per_s']:,.0f} documents/s, {results['tokens_per_s']:,.0f} tokens/s, "
          f"{results['ms_per_batch']:.2f} ms per batch; the checkpoint's data position: "
          f"{results['data_state_bytes']:,} bytes for {results['streams_with_a_position']} streams")
    write_json(results, json_path)
    return results


def write_json(results: dict, path: str | Path | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)
