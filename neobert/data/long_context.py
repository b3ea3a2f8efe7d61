"""LongEmbed's synthetic long-context retrieval tasks (Zhu et al., 2024, "LongEmbed: Extending Embedding Models for
Long Context Retrieval", Section 3.1), generated offline with a fixed seed, at lengths measured in the model
tokenizer's own tokens.

* **passkey** (LongEmbed's personalised passkey retrieval): each document is filler text with one sentence
  `"<name>'s pass key is <5 digits>. Remember it. <digits> is the pass key for <name>."` hidden at a random depth;
  its query is `"what is the pass key for <name>?"`. The filler is the one of the passkey literature (and
  LongEmbed's): "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.",
  repeated. All documents of one length share the filler, so only the hidden sentence tells them apart.
* **needle** (LongEmbed's needle retrieval): a short fact (`"The best thing to do in Lisbon is to ride the old
  tram up the hill."`) inserted at a random depth into a haystack of real prose; its query asks for the fact
  (`"What is the best thing to do in Lisbon?"`). LongEmbed's haystack is Paul Graham's essays; ours is the offline
  demo corpus (CPython's documentation topics, `neobert.data.demo_corpus`), a different passage per document.
  Facts are (city, question) pairs, so several documents of one length may be about one city and only the
  question tells them apart.

A document of length L has between L - tolerance and L tokens, special tokens included (what the model reads):
filler words are added while the document fits (a binary search over the number of filler words), and the
hidden sentence sits at a sentence boundary near its depth. Each query has one relevant document, and the
candidates are the documents of the same length (LongEmbed's splits `test_256`, `test_512`, ...).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

from neobert.data.demo_corpus import demo_documents

PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
FIRST_NAMES = ("Joyce", "Nathan", "Scarlett", "Esmeralda", "Avery", "Journey", "Kehlani", "Felicity", "Madelyn",
               "Brittany", "Rio", "Archer", "Bryson", "Malcolm", "Stella", "Omar", "Priya", "Tomas", "Ingrid",
               "Kofi", "Mei", "Lucas", "Anika", "Dmitri", "Fatima")
LAST_NAMES = ("Jenkins", "Munoz", "Kirk", "Kelly", "Hicks", "Lambert", "Bradshaw", "Stephens", "Garner", "Hart",
              "Garcia", "Peralta", "Jackson", "Kent", "Coffey", "Okafor", "Novak", "Silva", "Lindqvist", "Tanaka")
CITIES = ("Lisbon", "Nairobi", "Oslo", "Hanoi", "Lima", "Montreal", "Krakow", "Seville", "Osaka", "Dublin",
          "Tbilisi", "Bergen", "Cusco", "Adelaide", "Marrakesh", "Valparaiso", "Ljubljana", "Hobart", "Tallinn",
          "Cartagena", "Porto", "Zanzibar", "Reykjavik", "Kyoto", "Quito")
# (fact, question) templates; {answer} is drawn from the list beside each.
NEEDLE_TEMPLATES = (
    ("The best thing to do in {city} is to {answer}.", "What is the best thing to do in {city}?",
     ("ride the old tram up the hill", "eat grilled sardines by the harbour", "watch the sunset from the fort",
      "swim in the cold lake at dawn", "walk the market before it opens")),
    ("The oldest bridge in {city} was built by {answer}.", "Who built the oldest bridge in {city}?",
     ("a guild of stonemasons", "two brothers from the coast", "a retired sea captain", "monks from the valley",
      "the first railway company")),
    ("The favourite dish of people in {city} is {answer}.", "What is the favourite dish of people in {city}?",
     ("a stew of beans and smoked pork", "fried plantain with pepper sauce", "cold noodles with sesame",
      "a pie of lamb and apricots", "fish soup with saffron")),
    ("The tallest tower in {city} is painted {answer}.", "What colour is the tallest tower in {city}?",
     ("bright orange", "pale green", "deep blue", "white with red stripes", "golden yellow")),
)
MAX_WORD_TOKENS = 4  # haystack words of more tokens are left out, so a document ends within a few tokens of its length
TASK_NAMES = {"passkey": "LongContextPasskey", "needle": "LongContextNeedle"}


@dataclass(frozen=True)
class LongContextExample:
    task: str
    length: int  # the target length (tokens, special tokens included)
    tokens: int  # the document's actual length
    query_id: str
    query: str
    doc_id: str
    document: str
    hidden: str  # the passkey sentence or the needle, present exactly once in `document`
    depth: float  # where the hidden sentence starts, as a fraction of the document's words

    def to_dict(self) -> dict:
        return asdict(self)


def token_counter(tokenizer) -> Callable[[str], int]:
    """The number of tokens the model reads for a text: the tokenizer's ids with special tokens, untruncated."""
    def count(text: str) -> int:
        return len(tokenizer(text, truncation=False, return_token_type_ids=False,
                             return_attention_mask=False)["input_ids"])
    return count


def _haystack_words(task: str) -> list[str]:
    if task == "passkey":
        return PASSKEY_FILLER.split()
    return " ".join(d["content"].replace("\n", " ") for d in demo_documents()).split()


def _hidden_sentences(task: str, count: int, rng: random.Random) -> list[tuple[str, str]]:
    """`count` distinct (hidden sentence, query) pairs."""
    if task == "passkey":
        names = [f"{first} {last}" for first in FIRST_NAMES for last in LAST_NAMES]
        if count > len(names):
            raise ValueError(f"passkey: at most {len(names)} documents per length, asked for {count}")
        keys = rng.sample(range(10000, 100000), count)
        return [(f"{name}'s pass key is {key}. Remember it. {key} is the pass key for {name}.",
                 f"what is the pass key for {name}?") for name, key in zip(rng.sample(names, count), keys)]
    pairs = [(city, template) for city in CITIES for template in NEEDLE_TEMPLATES]
    if count > len(pairs):
        raise ValueError(f"needle: at most {len(pairs)} documents per length, asked for {count}")
    return [(fact.format(city=city, answer=rng.choice(answers)), question.format(city=city))
            for city, (fact, question, answers) in rng.sample(pairs, count)]


def _generator(task: str, length: int, seed: int) -> random.Random:
    """The seeded generator of one task and length: its hidden sentences first, then where each goes."""
    return random.Random(f"{seed}-{task}-{length}")


def hidden_sentence_tokens(task: str, lengths: Sequence[int], count: Callable[[str], int],
                           examples_per_length: int = 100, seed: int = 0) -> dict[int, int]:
    """The tokens (`count`'s) of the longest hidden sentence `generate` draws at each length: a length must be at
    least that (a document holds its sentence whole)."""
    return {length: max(count(hidden) for hidden, _ in
                        _hidden_sentences(task, examples_per_length, _generator(task, length, seed)))
            for length in lengths}


def _build(words: list[str], start: int, n: int, hidden: str, depth: float) -> tuple[str, float]:
    """`n` filler words from `start` (wrapping around) with `hidden` at the sentence boundary at or before
    `depth` of them."""
    filler = [words[(start + i) % len(words)] for i in range(n)]
    at = round(depth * n)
    while at > 0 and not filler[at - 1].endswith((".", "?", "!")):
        at -= 1
    return " ".join(filler[:at] + [hidden] + filler[at:]), (at / n if n else 0.0)


def fit_document(words: list[str], start: int, hidden: str, depth: float, length: int,
                 count: Callable[[str], int]) -> tuple[str, float, int]:
    """The longest document (filler from `start` + `hidden` near `depth`) of at most `length` tokens:
    (text, actual depth, tokens)."""
    low, high = 0, length  # every word is at least one token
    if count(hidden) > length:
        raise ValueError(f"length {length} is shorter than the hidden sentence alone ({count(hidden)} tokens)")
    while low < high:  # the largest n whose document fits
        middle = (low + high + 1) // 2
        if count(_build(words, start, middle, hidden, depth)[0]) <= length:
            low = middle
        else:
            high = middle - 1
    text, actual_depth = _build(words, start, low, hidden, depth)
    return text, actual_depth, count(text)


def generate(task: str, lengths: Sequence[int], count: Callable[[str], int], examples_per_length: int = 100,
             seed: int = 0, tolerance: int = 16) -> list[LongContextExample]:
    """The examples of one task at each length, deterministic in (task, lengths, tokenizer, seed); every document
    has between length - tolerance and length tokens (`count`'s)."""
    if task not in TASK_NAMES:
        raise ValueError(f"unknown long-context task {task!r}; known: {list(TASK_NAMES)}")
    words = _haystack_words(task)
    # Words of many tokens (code, URLs) would leave a gap at the end of a document larger than the tolerance.
    special = count("")
    short = {w for w in set(words) if count(w) - special <= MAX_WORD_TOKENS}
    words = [w for w in words if w in short]
    sentence_starts = [i for i, word in enumerate(words) if i == 0 or words[i - 1].endswith((".", "?", "!"))]
    examples = []
    for length in lengths:
        rng = _generator(task, length, seed)
        for index, (hidden, query) in enumerate(_hidden_sentences(task, examples_per_length, rng)):
            start = rng.choice(sentence_starts)  # a document starts at a sentence of the filler
            depth = rng.random()
            text, actual_depth, tokens = fit_document(words, start, hidden, depth, length, count)
            if not length - tolerance <= tokens <= length:
                raise ValueError(f"{task}: a document of {tokens} tokens for length {length} (tolerance {tolerance})")
            examples.append(LongContextExample(
                task=task, length=length, tokens=tokens, query_id=f"ctx{length}_query{index}", query=query,
                doc_id=f"ctx{length}_doc{index}", document=text, hidden=hidden, depth=round(actual_depth, 4)))
    return examples


def retrieval_splits(examples: Sequence[LongContextExample]) -> dict[str, tuple[dict, dict, dict]]:
    """LongEmbed's layout: split `test_<length>` -> (queries, corpus, qrels), the corpus being the documents of
    that length."""
    splits: dict[str, tuple[dict, dict, dict]] = {}
    for example in examples:
        queries, corpus, qrels = splits.setdefault(f"test_{example.length}", ({}, {}, {}))
        queries[example.query_id] = example.query
        corpus[example.doc_id] = example.document
        qrels[example.query_id] = {example.doc_id: 1}
    return splits
