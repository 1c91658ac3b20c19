"""A generated, no-download knowledge base of fictional people for fast end-to-end runs.

Each entity is a made-up person ("Varnel Oskatine") with five attributes (relations):
birthplace town, occupation, year they founded a business, musical instrument and
employer organisation. The corpus has ONE passage per (entity, relation): a sentence
stating that fact plus a little filler mentioning the entity, titled with the entity's
name. Since all passages of an entity share its name, a retriever has to match the
*relation* asked about, not just the name; some names also share a first or last part.

There is one question per (entity, relation), worded differently from its passage
(templates picked by the seeded RNG); its gold passage has grade 1 and its short answer
(the attribute value, verbatim in the passage, never in the question) is in ``answers``.

Splits are BY ENTITY: entities are shuffled with the seed and partitioned into
train / dev / test by ``dev_fraction`` / ``test_fraction``, so dev and test questions are
about people never asked about in training. The corpus always holds all passages.

Everything is drawn from one ``random.Random(seed)`` over lists (never sets or hash
order), so the same arguments give byte-identical data regardless of PYTHONHASHSEED.
"""

from __future__ import annotations

import random

from .types import DataError, Passage, RetrievalData

__all__ = ["make_synthetic", "RELATIONS"]

RELATIONS = ("birthplace", "occupation", "founded_year", "instrument", "employer")
SPLITS = ("train", "dev", "test")

# Syllable pieces for pronounceable made-up names. Inner syllables take only simple
# codas so names do not pile up unreadable consonant clusters.
_ONSETS = [
    "b",
    "d",
    "f",
    "g",
    "h",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "z",
    "br",
    "dr",
    "gr",
    "kr",
    "th",
    "sh",
    "st",
    "tr",
    "qu",
    "w",
]
_VOWELS = ["a", "e", "i", "o", "u", "ae", "ei", "ou", "ia", "o", "a", "e"]
_INNER_CODAS = ["", "", "", "n", "r", "l", "s"]
_FINAL_CODAS = ["", "n", "r", "l", "s", "th", "nd", "rk", "m", "ne", "lle", "tine"]
_TOWN_SUFFIXES = ["mere", "ford", "wick", "holm", "stead", "by", "haven", "moor"]
_ORG_KINDS = [
    "Shipping Company",
    "Glassworks",
    "Observatory",
    "Printing House",
    "Botanical Society",
    "Rail Consortium",
    "Trading Guild",
    "Weaving Mill",
    "Savings Bank",
    "Map Bureau",
]

_TOWN_KINDS = ["river town", "harbour town", "hill town", "market town", "mining town"]
_OCCUPATIONS = [
    "glassblower",
    "cartographer",
    "beekeeper",
    "archivist",
    "clockmaker",
    "ferry pilot",
    "stonemason",
    "botanist",
    "tax assessor",
    "bookbinder",
    "chimney sweep",
    "surveyor",
    "apothecary",
    "tailor",
    "engraver",
    "orchardist",
]
_INSTRUMENTS = [
    "oboe",
    "hurdy-gurdy",
    "cello",
    "bassoon",
    "zither",
    "harp",
    "accordion",
    "viola",
    "lute",
    "bagpipes",
    "dulcimer",
    "trombone",
    "flute",
    "banjo",
]
_SHOPS = ["tea room", "bookbindery", "repair shop", "bakery", "print shop", "boatyard"]

# Passage fact templates: the wording questions must NOT reuse verbatim.
_FACTS = {
    "birthplace": [
        "{name} was born in the {kind} of {value}.",
        "{name} first drew breath in {value}, a small {kind} by the coast road.",
    ],
    "occupation": [
        "By trade, {name} is {article} {value}, a line of work taken up after leaving school.",
        "{name} earns a living as {article} {value} and has done so for many years.",
    ],
    "founded_year": [
        "In {value}, {name} opened a small {shop} that still carries the family name.",
        "{name} established a modest {shop} in {value} with borrowed money.",
    ],
    "instrument": [
        "{name} learned the {value} as a child and still performs it at local gatherings.",
        "Evenings find {name} practising the {value} for the village band.",
    ],
    "employer": [
        "{name} is currently employed by the {value}, working mostly from its main office.",
        "For the past decade {name} has drawn a salary from the {value}.",
    ],
}
_QUESTIONS = {
    "birthplace": [
        "In which town did {name}'s life begin?",
        "What is the birthplace of {name}?",
        "Which town does {name} originally come from?",
    ],
    "occupation": [
        "What is {name}'s profession?",
        "What kind of job does {name} hold?",
        "Which trade does {name} practise?",
    ],
    "founded_year": [
        "When did {name} set up their own business?",
        "In what year did {name} start a business?",
        "What year did {name} go into business for themselves?",
    ],
    "instrument": [
        "Which musical instrument does {name} play?",
        "On which instrument does {name} perform?",
        "What instrument can {name} be heard playing?",
    ],
    "employer": [
        "Which organisation employs {name}?",
        "Who does {name} work for?",
        "Which company or institution pays {name}'s wages?",
    ],
}
_FILLERS = [
    "Friends describe {first} as {adj} and {adj2}.",
    "{first} is rarely seen without a {item}.",
    "Most mornings {first} walks the long way past the {place}.",
    "Neighbours say {first} is {adj} but never {adj2}.",
    "{first} keeps a {garden} little garden full of {plant}.",
]
_ADJS = ["patient", "cheerful", "stubborn", "quiet", "generous", "restless", "careful", "witty", "shy"]
_ITEMS = ["battered notebook", "green scarf", "walking stick", "pocket compass", "tin of mints"]
_PLACES = ["old mill", "canal bridge", "chapel", "post office", "village green"]
_GARDENS = ["tidy", "rambling", "crowded", "sunny", "walled"]
_PLANTS = ["marigolds", "herbs", "tomatoes", "roses", "runner beans"]


def _syllable(rng: random.Random, final: bool) -> str:
    """Draw one name syllable; final syllables may end in a heavier coda."""
    return rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_FINAL_CODAS if final else _INNER_CODAS)


def _word(rng: random.Random, n_syllables: int) -> str:
    """Build a capitalised made-up word from ``n_syllables`` syllables."""
    parts = [_syllable(rng, final=i == n_syllables - 1) for i in range(n_syllables)]
    return "".join(parts).capitalize()


def _unique_words(
    rng: random.Random,
    count: int,
    syllables: tuple[int, ...],
    banned: list[str],
    taken: set[str],
    suffixes: list[str] | None = None,
) -> list[str]:
    """Draw ``count`` distinct words containing no banned fragment (case-insensitive)."""
    out: list[str] = []
    while len(out) < count:
        w = _word(rng, rng.choice(syllables)) + (rng.choice(suffixes) if suffixes else "")
        low = w.lower()
        # A name part containing an answer value ("Harpel" vs "harp") would leak the
        # answer into the question; reject such draws.
        if low in taken or len(w) > 12 or any(b in low for b in banned):
            continue
        taken.add(low)  # membership only; iteration order never matters here
        out.append(w)
    return out


def _article(word: str) -> str:
    """Return the English indefinite article for ``word``."""
    return "an" if word[0] in "aeiou" else "a"


def split_sizes(num_entities: int, split: str, dev_fraction: float, test_fraction: float) -> tuple[int, int]:
    """(dev entities, test entities) of the synthetic KB; a DataError names the setting that cannot work."""
    if isinstance(num_entities, bool) or not isinstance(num_entities, int) or num_entities < 10:
        raise DataError(f"data.num_entities must be an integer >= 10, got {num_entities!r}")
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r} for the synthetic KB; valid choices: {', '.join(SPLITS)}")
    for key, frac in (("data.dev_fraction", dev_fraction), ("data.test_fraction", test_fraction)):
        if not 0.0 <= frac < 1.0:
            raise DataError(f"{key} must be in [0, 1), got {frac!r}")
    n_dev, n_test = round(num_entities * dev_fraction), round(num_entities * test_fraction)
    # A positive fraction must give at least one entity, otherwise that split is silently empty.
    n_dev = max(n_dev, 1) if dev_fraction > 0 else 0
    n_test = max(n_test, 1) if test_fraction > 0 else 0
    if n_dev + n_test >= num_entities:
        raise DataError(
            f"data.dev_fraction + data.test_fraction ({dev_fraction} + {test_fraction}) "
            f"leave no training entities out of data.num_entities={num_entities}"
        )
    if (split == "dev" and n_dev == 0) or (split == "test" and n_test == 0):
        raise DataError(f"split {split!r} is empty: data.{split}_fraction is 0")

    return n_dev, n_test


def make_synthetic(
    num_entities: int = 200, seed: int = 0, split: str = "dev", dev_fraction: float = 0.15, test_fraction: float = 0.15
) -> RetrievalData:
    """Generate a deterministic fictional-people knowledge base as a RetrievalData."""
    n_dev, n_test = split_sizes(num_entities, split, dev_fraction, test_fraction)
    rng = random.Random(seed)
    taken: set[str] = set()
    banned = [v.lower() for v in _OCCUPATIONS + _INSTRUMENTS]
    towns = _unique_words(rng, 24, (1, 2), banned, taken, _TOWN_SUFFIXES)
    orgs = [
        f"{p} {kind}" for p, kind in zip(_unique_words(rng, 20, (2,), banned, taken), rng.choices(_ORG_KINDS, k=20))
    ]
    banned += [t.lower() for t in towns] + [o.split()[0].lower() for o in orgs]
    # Pools smaller than num_entities make many people share a first or last name,
    # so the name alone does not single out an entity's passages.
    firsts = _unique_words(rng, max(4, round(num_entities * 0.5)), (2,), banned, taken)
    lasts = _unique_words(rng, max(4, round(num_entities * 0.6)), (2, 3), banned, taken)
    pairs = rng.sample(range(len(firsts) * len(lasts)), num_entities)  # distinct -> unique names
    names = [(firsts[i // len(lasts)], lasts[i % len(lasts)]) for i in pairs]

    order = list(range(num_entities))
    rng.shuffle(order)
    split_of: dict[int, str] = {}
    for rank, ent in enumerate(order):
        split_of[ent] = "dev" if rank < n_dev else "test" if rank < n_dev + n_test else "train"

    width = max(4, len(str(num_entities * len(RELATIONS))))
    corpus: dict[str, Passage] = {}
    queries: dict[str, str] = {}
    answers: dict[str, list[str]] = {}
    qrels: dict[str, dict[str, dict[str, int]]] = {s: {} for s in SPLITS}
    for ent, (first, last) in enumerate(names):
        name = f"{first} {last}"
        values = {
            "birthplace": rng.choice(towns),
            "occupation": rng.choice(_OCCUPATIONS),
            "founded_year": str(rng.randint(1820, 1990)),
            "instrument": rng.choice(_INSTRUMENTS),
            "employer": rng.choice(orgs),
        }
        for rel in RELATIONS:
            value = values[rel]
            fact = rng.choice(_FACTS[rel]).format(
                name=name, value=value, kind=rng.choice(_TOWN_KINDS), article=_article(value), shop=rng.choice(_SHOPS)
            )
            adj, adj2 = rng.sample(_ADJS, 2)
            filler = rng.choice(_FILLERS).format(
                first=first,
                adj=adj,
                adj2=adj2,
                item=rng.choice(_ITEMS),
                garden=rng.choice(_GARDENS),
                place=rng.choice(_PLACES),
                plant=rng.choice(_PLANTS),
            )
            num = len(corpus) + 1
            did, qid = f"d{num:0{width}d}", f"q{num:0{width}d}"
            corpus[did] = Passage(id=did, title=name, text=f"{fact} {filler}")
            queries[qid] = rng.choice(_QUESTIONS[rel]).format(name=name)
            answers[qid] = [value]
            qrels[split_of[ent]][qid] = {did: 1}

    return RetrievalData(
        name="synthetic",
        corpus=corpus,
        queries=queries,
        train_qrels=qrels["train"],
        eval_qrels=qrels[split],
        split=split,
        answers=answers,
    )
