"""A generated folder of long, multi-section articles about confusable fictional people (experiment=docs_quickstart).

Why it is hard (zero-shot MiniLM does not saturate it, unlike the one-fact-a-passage synthetic KB):
- people come in families of three sharing a last name with near-identical first names (Varnel / Varnela /
  Varnelo), and every family has a twin family whose last name differs by one letter (Oskatine / Oskatane);
- every article has distractor sections: a "Family" section stating the siblings' own facts next to their names,
  and a "Namesakes" section about the twin family's look-alike, so the best-matching chunk for a question about
  Varnela is often a chunk of Varnel's article;
- facts are spread over sections (birthplace in Early life, trade and employer in Career, instrument in Music),
  with filler between them, so one question's evidence sits in one chunk and the rest of the document is noise;
- some questions name nobody and combine three facts from different sections ("Which cartographer born in
  Brennmere plays the oboe?"), answered by exactly one person.

Files: `articles/<slug>.md` (most), `.html` (with script/style that must not be indexed) and `.txt`; queries.jsonl
and qrels/{train,dev,test}.tsv on document ids (`articles/<slug>`). Splits are by family: dev and test ask about
people whose families were never asked about in training. Deterministic: one random.Random(seed) over lists.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

from ragtrain.data.synthetic import (
    _INSTRUMENTS,
    _OCCUPATIONS,
    _ORG_KINDS,
    _SHOPS,
    _TOWN_SUFFIXES,
    _article,
    _unique_words,
)
from ragtrain.data.types import DataError

__all__ = ["write_docs_synthetic"]

_FIRST_VARIANTS = ("", "a", "o")  # Varnel, Varnela, Varnelo
_LAST_SWAPS = {"a": "o", "e": "a", "i": "e", "o": "a", "u": "i"}  # one vowel changed: Oskatine -> Oskatane
_FACT = {
    "birthplace": [
        "{first} was born in {value}, where the family kept a small house near the water.",
        "{first} grew up in {value} and went to the village school there.",
    ],
    "occupation": [
        "{first} trained as {article} {value} and has worked in that trade ever since.",
        "For most of their working life {first} has been {article} {value}.",
    ],
    "employer": [
        "Today {first} is on the payroll of the {value}.",
        "{first} later took a permanent post with the {value}.",
    ],
    "founded_year": [
        "In {value} {first} opened a {shop} of their own with borrowed money.",
        "{first} set up a small {shop} in {value}, which is still open.",
    ],
    "instrument": [
        "{first} plays the {value} and rarely misses a rehearsal of the town band.",
        "Music matters to {first}: the {value} has been their instrument since childhood.",
    ],
}
_QUESTION = {
    "birthplace": ["Where was {name} born?", "What is the home town of {name}?"],
    "occupation": ["What does {name} do for a living?", "What is the trade of {name}?"],
    "employer": ["Which organisation does {name} work for?", "Who employs {name}?"],
    "founded_year": ["In which year did {name} open a business?", "When did {name} start their own shop?"],
    "instrument": ["Which instrument does {name} play?", "What musical instrument does {name} perform on?"],
}
_FILLER = [
    "The winters there are long, and {first} spends them mending nets and reading old almanacs.",
    "Neighbours remember {first} as patient with children and impatient with officials.",
    "{first} keeps a notebook of weather observations that now fills several shelves.",
    "On market days {first} can be found arguing about the price of apples.",
    "A fire in the old granary destroyed many of the family's papers, so some dates are uncertain.",
    "{first} once walked the whole coast road in a single summer, sleeping in barns.",
    "Local newspapers mention {first} mostly in connection with the annual regatta.",
    "{first} is said to dislike photographs, and only two portraits are known.",
    "The family name appears in parish records going back several generations.",
    "{first} still answers letters by hand, usually on the back of old invoices.",
]
_SIBLING = [
    "{rel} {name} became {article} {occupation} and plays the {instrument}.",
    "{rel} {name}, born in {town}, works for the {employer}.",
    "{rel} {name} opened a {shop} in {year} and is known for playing the {instrument}.",
]
_NAMESAKE = "Not to be confused with {name}, {article} {occupation} from {town} who plays the {instrument}."
_DESCRIBE = [
    "Which {occupation} born in {town} plays the {instrument}?",
    "Who is the {occupation} from {town} that plays the {instrument}?",
]


def _people(rng: random.Random, num_entities: int) -> list[dict[str, str]]:
    """Entities in families of three (near-identical first names) and twin families (last names one letter apart)."""
    banned = [v.lower() for v in _OCCUPATIONS + _INSTRUMENTS]
    taken: set[str] = set()
    towns = _unique_words(rng, 12, (1, 2), banned, taken, _TOWN_SUFFIXES)
    orgs = [f"{p} {k}" for p, k in zip(_unique_words(rng, 10, (2,), banned, taken), rng.choices(_ORG_KINDS, k=10))]
    n_fam = -(-num_entities // 3)
    bases = _unique_words(rng, n_fam, (2,), banned, taken)
    lasts = _unique_words(rng, -(-n_fam // 2), (2, 3), banned, taken)
    people: list[dict[str, str]] = []
    for f in range(n_fam):
        last = lasts[f // 2]
        if f % 2:  # the twin family: one vowel of the last name changed
            i = max(i for i, ch in enumerate(last) if ch in _LAST_SWAPS)
            last = last[:i] + _LAST_SWAPS[last[i]] + last[i + 1 :]
        town = rng.choice(towns)  # siblings mostly share a birthplace
        for v in _FIRST_VARIANTS:
            if len(people) == num_entities:
                break
            first = bases[f] + v
            people.append(
                {
                    "first": first,
                    "name": f"{first} {last}",
                    "family": str(f),
                    "birthplace": town if rng.random() < 0.7 else rng.choice(towns),
                    "occupation": rng.choice(_OCCUPATIONS),
                    "employer": rng.choice(orgs),
                    "founded_year": str(rng.randint(1850, 1990)),
                    "instrument": rng.choice(_INSTRUMENTS),
                    "shop": rng.choice(_SHOPS),
                }
            )
    return people


def _sections(rng: random.Random, p: dict[str, str], family: list[dict[str, str]], twin: dict[str, str] | None):
    """[(heading, [sentences])] of one article."""

    def fact(rel: str) -> str:
        return rng.choice(_FACT[rel]).format(first=p["first"], value=p[rel], article=_article(p[rel]), shop=p["shop"])

    pool = rng.sample(_FILLER, len(_FILLER))  # no filler sentence twice in one article

    def filler(k: int) -> list[str]:
        return [pool.pop().format(first=p["first"]) for _ in range(k)]

    lead = [
        f"{p['name']} is a member of the {p['name'].split()[-1]} family and the subject of this article.",
        *filler(1),
    ]
    early = [fact("birthplace"), *filler(2)]
    career = [fact("occupation"), *filler(1), fact("employer"), fact("founded_year")]
    music = [*filler(1), fact("instrument")]
    fam = [
        rng.choice(_SIBLING).format(
            rel="Their sibling",
            name=s["name"],
            article=_article(s["occupation"]),
            occupation=s["occupation"],
            instrument=s["instrument"],
            town=s["birthplace"],
            employer=s["employer"],
            shop=s["shop"],
            year=s["founded_year"],
        )
        for s in family
        if s is not p
    ]
    out = [("", lead), ("Early life", early), ("Career", career), ("Music", music), ("Family", fam or filler(1))]
    if twin is not None:
        out.append(
            (
                "Namesakes",
                [
                    _NAMESAKE.format(
                        name=twin["name"],
                        article=_article(twin["occupation"]),
                        occupation=twin["occupation"],
                        town=twin["birthplace"],
                        instrument=twin["instrument"],
                    )
                ],
            )
        )
    out.append(("Later years", filler(2)))
    rng.shuffle(out[1:4])  # facts are not always in the same place
    return out


def _render(fmt: str, title: str, sections) -> str:
    """The article as Markdown, HTML (with script/style that must not be indexed) or plain text."""
    if fmt == "md":
        parts = [f"# {title}"] + [(f"## {h}\n\n" if h else "") + " ".join(s) for h, s in sections]
        return "\n\n".join(parts) + "\n"
    if fmt == "html":
        body = "".join((f"<h2>{h}</h2>" if h else "") + f"<p>{' '.join(s)}</p>\n" for h, s in sections)
        return (
            f"<!DOCTYPE html><html><head><title>{title}</title><style>p {{ color: #333 }}</style></head>\n"
            f"<body><script>var tracker = 'analytics id 42';</script><h1>{title}</h1>\n{body}</body></html>\n"
        )
    return "\n\n".join(" ".join(s) for _, s in sections) + "\n"


def write_docs_synthetic(
    root: str | Path, num_entities: int = 120, seed: int = 0, dev_fraction: float = 0.15, test_fraction: float = 0.15
) -> Path:
    """Write the article folder (documents, queries.jsonl, qrels/{train,dev,test}.tsv) into `root`; returns it."""
    root = Path(root)
    marker = root / ".docs_synthetic"  # hidden: never read as a document
    if root.exists() and any(root.iterdir()):
        if not marker.exists():
            raise DataError(f"{root} is not empty and was not written by write_docs_synthetic: refusing to write there")
        shutil.rmtree(root)  # our own earlier output (a resumed run): regenerate it whole
    root.mkdir(parents=True)
    marker.write_text(f"num_entities={num_entities} seed={seed}\n")
    rng = random.Random(seed)
    people = _people(rng, num_entities)
    families: dict[str, list[dict[str, str]]] = {}
    for p in people:
        families.setdefault(p["family"], []).append(p)
    fam_ids = sorted(families, key=int)
    order = fam_ids[:]
    rng.shuffle(order)
    n_dev, n_test = max(1, round(len(order) * dev_fraction)), max(1, round(len(order) * test_fraction))
    split_of = {f: "dev" if i < n_dev else "test" if i < n_dev + n_test else "train" for i, f in enumerate(order)}

    (root / "articles").mkdir(parents=True, exist_ok=True)
    (root / "qrels").mkdir(exist_ok=True)
    combos: dict[tuple[str, str, str], int] = {}
    for p in people:
        key = (p["occupation"], p["birthplace"], p["instrument"])
        combos[key] = combos.get(key, 0) + 1
    queries: list[dict[str, Any]] = []
    qrels: dict[str, list[tuple[str, str]]] = {"train": [], "dev": [], "test": []}
    for p in people:
        f = int(p["family"])
        twin_fam = families.get(str(f ^ 1), [])
        twin = twin_fam[families[p["family"]].index(p) % len(twin_fam)] if twin_fam else None
        slug = p["name"].lower().replace(" ", "-")
        fmt = rng.choices(["md", "html", "txt"], weights=[6, 3, 1])[0]
        text = _render(fmt, p["name"], _sections(rng, p, families[p["family"]], twin))
        (root / "articles" / f"{slug}.{fmt}").write_text(text, encoding="utf-8")
        doc_id = f"articles/{slug}"
        asked = rng.sample(sorted(_QUESTION), 3)
        for rel in asked:
            queries.append(
                {
                    "_id": f"q{len(queries):05d}",
                    "text": rng.choice(_QUESTION[rel]).format(name=p["name"]),
                    "metadata": {"answer": p[rel]},
                }
            )
            qrels[split_of[p["family"]]].append((queries[-1]["_id"], doc_id))
        if combos[(p["occupation"], p["birthplace"], p["instrument"])] == 1:  # a description that fits one person
            text = rng.choice(_DESCRIBE).format(
                occupation=p["occupation"], town=p["birthplace"], instrument=p["instrument"]
            )
            queries.append({"_id": f"q{len(queries):05d}", "text": text, "metadata": {"answer": p["name"]}})
            qrels[split_of[p["family"]]].append((queries[-1]["_id"], doc_id))
    with open(root / "queries.jsonl", "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(q) + "\n" for q in queries)
    for split, rows in qrels.items():
        with open(root / "qrels" / f"{split}.tsv", "w", encoding="utf-8") as fh:
            fh.write("query-id\tcorpus-id\tscore\n")
            fh.writelines(f"{q}\t{d}\t1\n" for q, d in rows)
    return root
