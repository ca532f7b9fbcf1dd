"""Facts no pretrained model can know: made-up people born in made-up towns, for the fine-tuning
benches (the learning check teaches them; the speed comparison trains on them)."""
from __future__ import annotations

import random

SYLLABLES = ("zor", "quel", "vam", "trin", "osk", "bel", "dra", "mir", "tux", "plo", "fen", "gar", "yth", "cor", "wex", "lun")


def _name(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(parts)).capitalize()


def invented_facts(count: int, seed: int) -> list[tuple[str, str]]:
    """(person, town) pairs of made-up names: nothing a pretrained model can know."""
    rng = random.Random(seed)
    facts, people = [], set()
    while len(facts) < count:
        person = f"{_name(rng, 2)} {_name(rng, 2)}"
        if person not in people:
            people.add(person)
            facts.append((person, _name(rng, 3)))
    return facts
