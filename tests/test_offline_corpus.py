"""The offline corpus for CPU pretraining: prose from documentation files and docstrings, no code, no tables, no
duplicates, no unreadable files, documents cut at paragraph boundaries, a stable order and content hash."""

from __future__ import annotations

import json

import pytest

from neobert.data.offline_corpus import chunk_paragraphs, is_prose, offline_documents, write_offline_corpus

PROSE = ("The encoder reads every token of the sentence at once, so each position can look at the words on its left "
         "and on its right before the model predicts what was hidden there.")
OTHER = ("Masked language modelling hides a fifth of the tokens and asks the network to recover them from the "
         "surrounding context, which teaches it a great deal about how words combine.")


def test_prose_is_kept_and_code_tables_and_short_lines_are_not():
    assert is_prose(PROSE, 12) and is_prose(OTHER, 12)
    assert not is_prose(">>> import torch\n>>> torch.ones(3, 4).sum(dim=0) + torch.zeros(4) * 2.5 - 1", 3)
    assert not is_prose("+------+------+\n| name | size |\n+------+------+\n| a | 1 |", 3)
    assert not is_prose("Returns the tensor.", 12)
    assert not is_prose("x1_y2 = aa_bb[cc] + dd_ee(ff, gg) / hh_ii - jj_kk % ll_mm ** nn_oo // pp_qq", 3)


def test_chunks_join_paragraphs_up_to_the_limit_and_keep_a_long_one_whole():
    assert chunk_paragraphs(f"{PROSE}\n\n{OTHER}\n\n\n{PROSE}", 400) == [f"{PROSE}\n\n{OTHER}", PROSE]
    assert chunk_paragraphs(PROSE, 10) == [PROSE]
    assert chunk_paragraphs(" \n\n ", 100) == []


def test_documents_from_files_and_docstrings_deduplicated_and_unreadable_files_skipped(tmp_path):
    package = tmp_path / "site-packages" / "pkg"
    package.mkdir(parents=True)
    (package / "README.rst").write_text(f"Title\n=====\n\n{PROSE}\n\n.. code-block:: python\n\n    x = 1\n")
    (package / "LICENSE.txt").write_text(f"{OTHER}\n")
    (package / "copy" / "LICENSE.txt").parent.mkdir()
    (package / "copy" / "LICENSE.txt").write_text(f"{OTHER.upper()}\n")  # the same text, other case: a duplicate
    (package / "module.py").write_text(f'"""{PROSE.replace("encoder", "decoder")}"""\n\ndef f():\n    """Short."""\n')
    (package / "broken.py").write_text("def (:\n")
    (package / "latin1.txt").write_bytes(("caf\xe9 " * 40).encode("latin-1"))
    (package / "data.md").write_bytes(b"\x00\x01\x02" * 10)
    documents = list(offline_documents([tmp_path], max_chars=1000, min_words=12))
    # Sorted path order: LICENSE.txt, README.rst (its title and code block dropped), ..., module.py's docstring.
    assert [d["content"] for d in documents] == [OTHER, PROSE, PROSE.replace("encoder", "decoder")]
    assert documents[0]["source"].endswith("pkg/LICENSE.txt") and documents[1]["source"].endswith("README.rst")
    assert documents[2]["source"].endswith("module.py:<module>")

    first = write_offline_corpus(tmp_path / "corpus.jsonl", [tmp_path])
    assert first["documents"] == 3 and first["characters"] == sum(len(d["content"]) for d in documents)
    rows = [json.loads(line) for line in (tmp_path / "corpus.jsonl").read_text().splitlines()]
    assert rows == documents
    again = write_offline_corpus(tmp_path / "corpus.jsonl", [tmp_path / "nothing"])  # an existing file is kept
    assert again == first
    with pytest.raises(ValueError, match="no prose"):
        write_offline_corpus(tmp_path / "empty.jsonl", [tmp_path / "nothing"])
    # A seeded order: the same documents, reproducibly permuted (seed 1 gives a different order than file order)
    shuffled = [write_offline_corpus(tmp_path / f"shuffled{i}.jsonl", [tmp_path], shuffle_seed=1) for i in (0, 1)]
    assert shuffled[0]["sha256"] == shuffled[1]["sha256"] != first["sha256"]
    rows = [json.loads(line) for line in (tmp_path / "shuffled0.jsonl").read_text().splitlines()]
    assert sorted(r["content"] for r in rows) == sorted(d["content"] for d in documents) and rows != documents


def test_the_command_line_writes_a_corpus_the_pretraining_data_reads(tmp_path, capsys):
    from experiments.offline_corpus import main
    from neobert.config.pretrain import PretrainDataConfig
    from neobert.data.corpus import iterate_documents
    from neobert.data.tokenizer import load_tokenizer

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "guide.md").write_text(f"# Guide\n\n{PROSE}\n\n{OTHER}\n")
    summary = main([str(tmp_path / "corpus.jsonl"), "--roots", str(docs), "--max-chars", "200"])
    assert summary["documents"] == 2 and json.loads(capsys.readouterr().out)["sha256"] == summary["sha256"]
    tokenizer = load_tokenizer("bert-base-uncased")
    read = list(iterate_documents(PretrainDataConfig(source=str(tmp_path / "corpus.jsonl")), tokenizer))
    assert len(read) == 2 and tokenizer.decode(read[0], skip_special_tokens=True).startswith("the encoder reads")
