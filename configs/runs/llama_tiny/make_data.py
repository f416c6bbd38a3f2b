"""Write the llama_tiny example's dataset: data.jsonl, one {"text": ...} story per line.

Deterministic (a seeded generator and fixed word lists, no download), so that every peer
who runs it gets the same bytes and the same data fingerprint (the run spec pins it).
The text is a small grammar's short stories: enough structure (agreement, recurring
characters, counting) for a small model's validation loss to fall within minutes.

    python configs/runs/llama_tiny/make_data.py   # writes configs/runs/llama_tiny/data.jsonl
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ["Ada", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "June", "Kai", "Lena"]
ANIMALS = ["cat", "dog", "fox", "owl", "hen", "goat", "frog", "bee", "crow", "mole"]
PLACES = ["garden", "forest", "market", "river", "library", "kitchen", "harbor", "meadow"]
THINGS = ["apple", "lamp", "kite", "book", "shell", "key", "drum", "map", "cup", "stone"]
COLORS = ["red", "blue", "green", "yellow", "white", "black", "silver", "orange"]
FEELINGS = ["happy", "sleepy", "curious", "brave", "hungry", "quiet", "proud", "tired"]
NUMBERS = ["two", "three", "four", "five", "six", "seven", "eight", "nine"]
RECORDS = 4000
SEED = 16


def story(rng: random.Random) -> str:
    name, friend = rng.sample(NAMES, 2)
    animal, place = rng.choice(ANIMALS), rng.choice(PLACES)
    thing, color = rng.choice(THINGS), rng.choice(COLORS)
    feeling, count = rng.choice(FEELINGS), rng.randrange(len(NUMBERS))
    lines = [
        f"{name} walked to the {place} with a {color} {thing}.",
        f"There {name} met {friend} and a {feeling} {animal}.",
        f'"Look at my {thing}," said {name}. "It is {color}."',
        f"The {animal} counted {NUMBERS[count]} {thing}s, then {NUMBERS[(count + 1) % 8]}.",
    ]
    if rng.random() < 0.5:
        lines.append(
            f"{friend} gave the {animal} the {color} {thing}, and the {animal} was {feeling}."
        )
    else:
        lines.append(f"{name} kept the {thing} and went home from the {place}.")
    return " ".join(lines)


def main() -> None:
    rng = random.Random(SEED)
    out = Path(__file__).with_name("data.jsonl")
    with out.open("w", encoding="utf-8") as f:
        for i in range(RECORDS):
            f.write(json.dumps({"id": i, "text": story(rng)}) + "\n")
    print(f"wrote {out} ({out.stat().st_size} bytes, {RECORDS} records)")


if __name__ == "__main__":
    main()
