"""Sequence packing (`neobert.data.packing`) and packed collation: over a few hundred seeded random document streams,
best fit keeps every document whole in one row unless it is longer than a row, puts it in the tightest open row
and closes rows exactly as specified; greedy fills every row and keeps the token stream; both resume exactly from
any point; packed batches of unequal rows are one row of real tokens, with no [PAD]."""

from __future__ import annotations

import copy
import pickle
import random

import pytest
import torch

from neobert.data.masking import IGNORE_INDEX, MLMMasker
from neobert.data.packing import BestFitPacker, GreedyPacker, make_packer, packing_efficiency

PAD_ID = 0
STRIDE = 1_000_000  # token id = document number x STRIDE + position + 1: unique per document position, never PAD_ID
# (max_length, open_rows): a pool of one row, small and large pools, a row length that is not a power of two.
CONFIGS = [(8, 1), (16, 4), (64, 64), (100, 7)]
SEEDS = range(60)  # x 4 configs = 240 streams per property


def random_documents(rng: random.Random, count: int, max_length: int) -> list[list[int]]:
    """Lengths in 1..3 x max_length, short ones as common as long ones so that rows fill from both."""
    lengths = [rng.choice([rng.randint(1, max(1, max_length // 4)), rng.randint(1, max_length),
                           rng.randint(1, 3 * max_length)]) for _ in range(count)]
    return [[number * STRIDE + position + 1 for position in range(length)] for number, length in enumerate(lengths)]


def document_of(token: int) -> int:
    return (token - 1) // STRIDE


def tokens(row: list[list[int]]) -> int:
    return sum(len(segment) for segment in row)


def pack_stream(packer, documents, batch_rows: int = 3) -> list:
    """Rows in the order a consumer gets them: batches of `batch_rows` taken as soon as ready (as the training
    stream does), then the flushed rest (as the last validation batch does)."""
    rows = []
    for ids in documents:
        packer.add(list(ids))
        assert packer.ready(packer.pending_rows()) and not packer.ready(packer.pending_rows() + 1)
        while packer.ready(batch_rows):
            rows += packer.take(batch_rows)
    packer.flush()
    rows += packer.take(packer.pending_rows())
    assert packer.pending_rows() == 0
    return rows


def assert_plain(value) -> None:
    """Only dicts, lists and ints: what a Lightning checkpoint pickles and the stream deep-copies per batch."""
    if isinstance(value, dict):
        for key, item in value.items():
            assert isinstance(key, str)
            assert_plain(item)
    elif isinstance(value, list):
        for item in value:
            assert_plain(item)
    else:
        assert type(value) is int, type(value)


# ---------------------------------------------------------------------------------------------- best fit
@pytest.mark.parametrize("max_length,open_rows", CONFIGS)
def test_best_fit_keeps_documents_whole_and_never_pads(max_length, open_rows):
    for seed in SEEDS:
        documents = random_documents(random.Random(seed), 60, max_length)
        rows = pack_stream(BestFitPacker(max_length, open_rows), documents)
        pieces: dict[int, list[tuple[int, list[int]]]] = {}  # document -> (row index, segment), in row order
        for index, row in enumerate(rows):
            assert 0 < tokens(row) <= max_length
            for segment in row:
                assert segment and PAD_ID not in segment
                number = document_of(segment[0])
                assert all(document_of(token) == number for token in segment)  # a segment is one document's
                pieces.setdefault(number, []).append((index, segment))
        assert sorted(pieces) == list(range(len(documents)))  # every document, and each exactly once
        for number, placed in pieces.items():
            document, segments = documents[number], [segment for _, segment in placed]
            assert [token for segment in segments for token in segment] == document  # in order, nothing lost
            if len(document) <= max_length:
                assert len(segments) == 1  # whole, in one row
                continue
            # Longer than a row: full rows of its own, closed one after the other, then the rest (if any) placed
            # like any document, in a row closed no earlier.
            full = len(document) // max_length
            assert all(rows[index] == [segment] and len(segment) == max_length for index, segment in placed[:full])
            assert [index for index, _ in placed[:full]] == list(range(placed[0][0], placed[0][0] + full))
            assert len(placed) == -(-len(document) // max_length)
            if len(placed) > full:
                assert placed[-1][0] > placed[full - 1][0]


def expected_step(open_before: list, document: list[int], max_length: int, open_rows: int) -> tuple[list, list]:
    """The rule, applied to the open rows (oldest first) before `document` arrives: (rows it closes, in closing
    order; open rows after it)."""
    full = (len(document) - 1) // max_length  # pieces that are rows on their own; the rest is placed
    closed = [[document[i * max_length : (i + 1) * max_length]] for i in range(full)]
    rest = document[full * max_length :]
    open_rows_now = [list(row) for row in open_before]
    fitting = [i for i, row in enumerate(open_rows_now) if max_length - tokens(row) >= len(rest)]
    if fitting:  # the least room that still holds it, the oldest on a tie
        target = min(fitting, key=lambda i: (max_length - tokens(open_rows_now[i]), i))
        open_rows_now[target] = open_rows_now[target] + [rest]
    else:
        open_rows_now.append([rest])
        target = len(open_rows_now) - 1
    if tokens(open_rows_now[target]) == max_length:
        closed.append(open_rows_now.pop(target))
    elif len(open_rows_now) > open_rows:  # the fullest, the oldest on a tie
        fullest = max(range(len(open_rows_now)), key=lambda i: (tokens(open_rows_now[i]), -i))
        closed.append(open_rows_now.pop(fullest))
    return closed, open_rows_now


def rule_rows(documents: list[list[int]], max_length: int, open_rows: int) -> list:
    """The rows best fit must close, in closing order, then the open ones oldest first (what flush closes)."""
    closed, open_after = [], []
    for document in documents:
        closed_now, open_after = expected_step(open_after, document, max_length, open_rows)
        assert len(open_after) <= open_rows and all(0 < tokens(row) < max_length for row in open_after)
        closed += closed_now
    return closed + open_after


@pytest.mark.parametrize("max_length,open_rows", CONFIGS)
def test_best_fit_places_every_document_by_the_rule(max_length, open_rows):
    for seed in SEEDS:
        documents = random_documents(random.Random(seed), 60, max_length)
        assert pack_stream(BestFitPacker(max_length, open_rows), documents) == rule_rows(documents, max_length,
                                                                                         open_rows)


def test_best_fit_hand_made_rows():
    def lengths(rows):
        return [[len(segment) for segment in row] for row in rows]

    def docs(*sizes):
        return [[number * STRIDE + position + 1 for position in range(size)] for number, size in enumerate(sizes)]

    # 4 and 7 open two rows; 3 fits both: best fit fills the 7-row (first fit would put it beside the 4, leaving
    # rows of 7 and 7 where 6 fits neither), then 6 fills the 4-row: two full rows.
    rows = pack_stream(BestFitPacker(10, open_rows=4), docs(4, 7, 3, 6), batch_rows=1)
    assert lengths(rows) == [[7, 3], [4, 6]]
    assert packing_efficiency(rows, 10) == 1.0
    # A tie in room goes to the oldest row.
    assert lengths(pack_stream(BestFitPacker(10, open_rows=4), docs(6, 6, 3))) == [[6, 3], [6]]
    # Too many open rows: the fullest is closed, the oldest on a tie; the new row itself when it is the fullest.
    packer = BestFitPacker(10, open_rows=2)
    for document in docs(7, 7, 7):
        packer.add(document)
    assert lengths(packer.take(5)) == [[7]]
    packer.flush()
    assert [row[0][0] for row in packer.take(5)] == [1 * STRIDE + 1, 2 * STRIDE + 1]  # the 2nd and 3rd 7s
    packer = BestFitPacker(10, open_rows=2)
    for document in docs(6, 5, 9):  # 9 fits neither the 6-row nor the 5-row: a third row, the fullest
        packer.add(document)
    assert lengths(packer.take(5)) == [[9]]
    packer.flush()
    assert lengths(packer.take(5)) == [[6], [5]]
    # A document of exactly a row is a row closed at once; a longer one is cut into full rows and the rest.
    packer = BestFitPacker(4, open_rows=2)
    packer.add(list(range(1, 5)))
    assert packer.take(5) == [[[1, 2, 3, 4]]]
    packer.add(list(range(1, 11)))
    assert packer.take(5) == [[[1, 2, 3, 4]], [[5, 6, 7, 8]]]
    packer.add([11, 12])  # joins the rest of the long document, which was placed like any document
    packer.flush()
    assert packer.take(5) == [[[9, 10], [11, 12]]] and packer.pending_rows() == 0


# ---------------------------------------------------------------------------------------------- greedy
@pytest.mark.parametrize("max_length,open_rows", CONFIGS)
def test_greedy_fills_every_row_and_keeps_the_token_stream(max_length, open_rows):
    for seed in SEEDS:
        documents = random_documents(random.Random(seed), 60, max_length)
        rows = pack_stream(make_packer("greedy", max_length, open_rows), documents)
        assert all(tokens(row) == max_length for row in rows[:-1]) and 0 < tokens(rows[-1]) <= max_length
        stream = [token for document in documents for token in document]
        assert [token for row in rows for segment in row for token in segment] == stream
        # Segments are cut exactly where a document or a row ends, nowhere else.
        ends, total = set(), 0
        for document in documents:
            total += len(document)
            ends.add(total)
        cuts = sorted(ends | set(range(max_length, total, max_length)))
        segment_ends, total = [], 0
        for row in rows:
            for segment in row:
                total += len(segment)
                segment_ends.append(total)
        assert segment_ends == cuts


# ---------------------------------------------------------------------------------------------- both
@pytest.mark.parametrize("mode", ["greedy", "best_fit"])
@pytest.mark.parametrize("max_length,open_rows", CONFIGS)
def test_resume_from_any_point_gives_the_rows_of_an_uninterrupted_packer(mode, max_length, open_rows):
    for seed in range(12):
        documents = random_documents(random.Random(1000 + seed), 30, max_length)
        expected = pack_stream(make_packer(mode, max_length, open_rows), documents)
        for stop in range(len(documents) + 1):
            first = make_packer(mode, max_length, open_rows)
            rows = []
            for ids in documents[:stop]:
                first.add(list(ids))
                while first.ready(3):
                    rows += first.take(3)
            saved = first.state()
            assert_plain(saved)
            resumed = make_packer(mode, max_length, open_rows)
            resumed.load(pickle.loads(pickle.dumps(saved)))  # as through a checkpoint
            assert resumed.state() == saved
            assert rows + pack_stream(resumed, documents[stop:]) == expected, (seed, stop)


@pytest.mark.parametrize("mode", ["greedy", "best_fit"])
def test_state_is_a_copy(mode):
    """The stream keeps each batch's state while the packer goes on; a resumed packer must not change the state it
    was loaded from either (one saved state may start several iterations)."""
    documents = random_documents(random.Random(5), 40, 16)
    packer = make_packer(mode, 16, 4)
    for ids in documents[:20]:
        packer.add(list(ids))
    saved = packer.state()
    frozen = copy.deepcopy(saved)
    for ids in documents[20:]:
        packer.add(list(ids))
    packer.take(2)
    packer.flush()
    assert saved == frozen
    resumed = make_packer(mode, 16, 4)
    resumed.load(saved)
    for ids in documents[20:]:
        resumed.add(list(ids))
    resumed.take(2)
    resumed.flush()
    assert saved == frozen


def test_make_packer_and_packing_efficiency():
    assert type(make_packer("greedy", 16, 4)) is GreedyPacker
    assert type(make_packer("best_fit", 16, 4)) is BestFitPacker
    for mode in ("none", "first_fit", "best-fit"):
        with pytest.raises(ValueError, match=mode):
            make_packer(mode, 16, 4)
    with pytest.raises(ValueError):
        BestFitPacker(16, open_rows=0)
    assert packing_efficiency([[[1, 2, 3]], [[4], [5, 6]]], 4) == 0.75  # 6 real tokens in 2 rows of 4
    assert packing_efficiency([[[1, 2], [3, 4]]], 4) == 1.0
    assert packing_efficiency([[[1]], [[2]], [[3]], [[4]]], 8) == 4 / 32


# ---------------------------------------------------------------------------------------------- collation
CLS, SEP, MASK = 1, 2, 3


def masker() -> MLMMasker:
    return MLMMasker(mask_token_id=MASK, pad_token_id=PAD_ID, special_token_ids=[CLS, SEP, MASK], vocab_size=100,
                     rate=0.5)


def assert_masked_from(batch: dict, original: torch.Tensor) -> None:
    """Labels hold the original id exactly where [MASK] went in, -100 everywhere else; specials never masked."""
    inputs, labels = batch["input_ids"], batch["labels"]
    masked = labels != IGNORE_INDEX
    assert masked.any() and (~masked).any()  # rate 0.5: a check that checks something
    assert torch.equal(masked, inputs == MASK)
    assert torch.equal(labels[masked], original[masked]) and torch.equal(inputs[~masked], original[~masked])
    assert not masked[(original == CLS) | (original == SEP)].any()


def test_collate_packed_unequal_rows_are_one_row_without_pad():
    rows = [[[CLS, 11, 12, SEP], [CLS, 13, SEP]], [[CLS, 14, 15, 16, 17, SEP]], [[21, 22]]]  # 7, 6 and 2 tokens
    batch = masker().collate_packed(rows, torch.Generator().manual_seed(0))
    assert set(batch) == {"input_ids", "labels", "cu_seqlens", "max_seqlen", "masked_index"}
    assert batch["input_ids"].shape == (1, 15) and batch["labels"].shape == (1, 15)
    assert torch.equal(batch["masked_index"], (batch["labels"].reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1))
    assert (batch["input_ids"] != PAD_ID).all()
    assert batch["cu_seqlens"].dtype == torch.int32 and batch["cu_seqlens"].tolist() == [0, 4, 7, 13, 15]
    assert batch["max_seqlen"] == 6
    assert_masked_from(batch, torch.tensor([[token for row in rows for segment in row for token in segment]]))


def test_collate_packed_equal_rows_keep_their_shape():
    rows = [[[CLS, 11, 12, SEP], [CLS, 13, SEP]], [[CLS, 14, 15, 16, 17, 18, SEP]]]  # 7 and 7 tokens
    batch = masker().collate_packed(rows, torch.Generator().manual_seed(0))
    assert batch["input_ids"].shape == (2, 7) and batch["cu_seqlens"].tolist() == [0, 4, 7, 14]
    assert batch["max_seqlen"] == 7
    assert_masked_from(batch, torch.tensor([[CLS, 11, 12, SEP, CLS, 13, SEP], [CLS, 14, 15, 16, 17, 18, SEP]]))


def test_best_fit_rows_collate_into_one_segment_per_piece():
    rng = random.Random(3)
    documents = [[CLS] + [10 + n % 80] * rng.randint(0, 38) + [SEP] for n in range(50)]  # 2..40 tokens
    rows = pack_stream(BestFitPacker(32, open_rows=4), documents)
    assert len({tokens(row) for row in rows}) > 1  # unequal rows, the case under test
    batch = masker().collate_packed(rows, torch.Generator().manual_seed(0))
    lengths = [len(segment) for row in rows for segment in row]
    assert batch["input_ids"].shape == (1, sum(lengths)) and (batch["input_ids"] != PAD_ID).all()
    assert torch.diff(batch["cu_seqlens"]).tolist() == lengths
    assert_masked_from(batch, torch.tensor([[token for row in rows for segment in row for token in segment]]))


@pytest.mark.parametrize("mode", ["greedy", "best_fit"])
def test_packers_copy_the_documents_they_are_given(mode):
    packer = make_packer(mode, 8, 4)
    short, long = [1, 2, 3], list(range(10, 30))
    packer.add(short)
    packer.add(long)
    short[0] = long[-1] = PAD_ID  # the caller reuses its lists
    packer.flush()
    rows = packer.take(packer.pending_rows())
    assert [token for row in rows for segment in row for token in segment].count(PAD_ID) == 0
