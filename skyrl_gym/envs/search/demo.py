"""A built-in corpus of 16 short passages and questions answered by them, for runs and
tests of ``search`` with no data to download.

    rows = make_search_rows(split="train")          # SkyRL's dataset schema
    write_corpus(DEMO_CORPUS, "corpus.jsonl")       # for corpus_path or the server CLI

Each question's answer appears in exactly one passage, which a BM25 search for the
question's own words ranks first; the gold answers list a few accepted spellings.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import Any

from skyrl_gym.envs.search.local_retriever import BM25Index
from skyrl_gym.error import EnvError

_PASSAGES = (
    ("Rome", "Rome is the capital city of Italy and sits on the river Tiber."),
    (
        "Mount Kilimanjaro",
        "Kilimanjaro, a dormant volcano in Tanzania, is the highest mountain in Africa.",
    ),
    (
        "Marie Curie",
        "Marie Curie was the first person to win Nobel Prizes in two sciences, physics and chemistry.",
    ),
    (
        "Photosynthesis",
        "Photosynthesis lets plants turn light, water and carbon dioxide into sugar, releasing oxygen.",
    ),
    (
        "Lake Baikal",
        "Lake Baikal in Siberia is the deepest lake on Earth, reaching about 1,640 metres.",
    ),
    ("The Great Gatsby", "The Great Gatsby is a 1925 novel written by F. Scott Fitzgerald."),
    (
        "Python (programming language)",
        "The Python programming language was created by Guido van Rossum and first released in 1991.",
    ),
    (
        "Jupiter",
        "Jupiter is the largest planet in the Solar System, a gas giant fifth from the Sun.",
    ),
    (
        "Penicillin",
        "Alexander Fleming discovered penicillin in 1928 when mould killed bacteria in a dish.",
    ),
    (
        "Canberra",
        "Canberra, not Sydney, is the capital of Australia; it was chosen as a compromise.",
    ),
    (
        "Amazon River",
        "The Amazon River carries more water to the sea than any other river in the world.",
    ),
    (
        "Mona Lisa",
        "The Mona Lisa, painted by Leonardo da Vinci, hangs in the Louvre museum in Paris.",
    ),
    ("Octopus", "An octopus has three hearts and blue blood rich in the protein hemocyanin."),
    (
        "Everest",
        "Tenzing Norgay and Edmund Hillary made the first confirmed ascent of Mount Everest in 1953.",
    ),
    ("Ulaanbaatar", "Ulaanbaatar is the capital of Mongolia and its largest city."),
    ("Helium", "Helium is the chemical element with atomic number 2 and the symbol He."),
)
DEMO_CORPUS: tuple[dict[str, str], ...] = tuple(
    {"id": str(i), "contents": f'"{title}"\n{text}'} for i, (title, text) in enumerate(_PASSAGES)
)
DEMO_QUESTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("What is the capital city of Italy?", ("Rome",)),
    ("What is the highest mountain in Africa?", ("Kilimanjaro", "Mount Kilimanjaro")),
    (
        "In which two sciences did Marie Curie win Nobel Prizes?",
        ("physics and chemistry", "chemistry and physics"),
    ),
    ("Which gas do plants release during photosynthesis?", ("oxygen",)),
    ("What is the deepest lake on Earth?", ("Lake Baikal", "Baikal")),
    (
        "Who wrote the novel The Great Gatsby?",
        ("F. Scott Fitzgerald", "Scott Fitzgerald", "Fitzgerald"),
    ),
    ("Who created the Python programming language?", ("Guido van Rossum",)),
    ("What is the largest planet in the Solar System?", ("Jupiter",)),
    ("Who discovered penicillin?", ("Alexander Fleming", "Fleming")),
    ("What is the capital of Australia?", ("Canberra",)),
    ("In which museum does the Mona Lisa hang?", ("the Louvre", "Louvre", "Louvre museum")),
    ("How many hearts does an octopus have?", ("three", "3")),
    ("In which year was the first confirmed ascent of Mount Everest?", ("1953",)),
    ("What is the capital of Mongolia?", ("Ulaanbaatar", "Ulan Bator")),
    ("Which chemical element has atomic number 2?", ("Helium", "He")),
)
DATA_SOURCE = "local_search"
INSTRUCTIONS = (
    "Answer the question. Reason inside <think>...</think>. To look something up, write "
    "<search>your query</search>; the passages found come back inside "
    "<information>...</information>. Give the final answer, a few words only, as "
    "<answer>...</answer>. Question: "
)
SYSTEM = "You are a careful assistant that checks facts before answering."


@lru_cache(maxsize=1)
def demo_index() -> BM25Index:
    return BM25Index(DEMO_CORPUS)


def make_search_rows(
    questions: Iterable[tuple[str, Iterable[str]]] = DEMO_QUESTIONS,
    *,
    split: str = "train",
    max_turns: int | None = None,
) -> list[dict[str, Any]]:
    """One row per question in SkyRL's schema (``prompt``, ``env_class``,
    ``reward_spec.ground_truth.target``, ``extra_info``; ``max_turns`` when given)."""
    rows = []
    for i, (question, answers) in enumerate(questions):
        targets = [answers] if isinstance(answers, str) else list(answers)
        if not isinstance(question, str) or not question or not targets:
            raise EnvError(f"questions[{i}]: expected (question, answers), got {question!r:.80}")
        row: dict[str, Any] = {
            "data_source": DATA_SOURCE,
            "prompt": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": INSTRUCTIONS + question},
            ],
            "env_class": "search",
            "reward_spec": {"method": "rule", "ground_truth": {"target": targets}},
            "extra_info": {"index": i, "question": question, "split": split},
        }
        if max_turns is not None:
            row["max_turns"] = max_turns
        rows.append(row)
    return rows


def write_corpus(docs: Iterable[Mapping[str, Any]], path: str | os.PathLike[str]) -> None:
    """``docs`` as JSON Lines, what ``corpus_path`` and ``load_corpus`` read."""
    with open(path, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps(dict(doc)) + "\n")
