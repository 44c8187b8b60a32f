"""Benchmark of the output guard (chatstream/guard.py). A script, not a test:

    .venv/bin/python tools/bench/guard_bench.py [--deltas 20000] [--rounds 5] [--seed 1]

Streams synthetic model output (words of 3-8 letters, some CJK, punctuation, split into deltas the
way tokenizers do: a leading space, long words in two pieces) through

* none:  the per-delta work of the app without a guard, the SSE frame (``chatstream.sse.encode_chat``);
* guard: ``Redactor.feed`` with 100 blocked terms, then the SSE frame of what it released;
* feed:  ``Redactor.feed`` alone,

and prints Markdown tables: microseconds per delta (median, p99, over all rounds), and how long the
first character of each delta waits before it is released. Times include the timer call (~0.1 us).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from chatstream.apis.chat import encode as encode_chat
from chatstream.guard import Redactor, redact_whole
from chatstream.stream import Chunk


def frame(text: str) -> bytes | None:
    return encode_chat(Chunk({"choices": [{"index": 0, "delta": {"content": text}}]}))


LETTERS = "etaoinshrdlcumwfgypbvkjxqz"
WEIGHTS = [
    12.7,
    9.1,
    8.2,
    7.5,
    7.0,
    6.7,
    6.3,
    6.1,
    6.0,
    4.3,
    4.0,
    2.8,
    2.8,
    2.4,
    2.4,
    2.2,
    2.0,
    2.0,
    1.9,
    1.5,
    1.0,
    0.8,
    0.2,
    0.2,
    0.1,
    0.1,
]


def make_corpus(rng: random.Random, n_deltas: int) -> tuple[list[str], list[str]]:
    """(deltas, 100 blocked terms); some terms occur in the text."""
    latin = sorted({"".join(rng.choices(LETTERS, WEIGHTS, k=rng.randint(3, 8))) for _ in range(3000)})
    cjk = ["".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(rng.randint(2, 4))) for _ in range(300)]
    vocab = latin + cjk
    weights = [1 / (rank + 1) for rank in range(len(vocab))]  # Zipf-like, so common words repeat
    rng.shuffle(vocab)

    common = vocab[:400]  # vocab is shuffled: these are the most frequent words
    terms = {w for w in rng.sample(common, 70) if w[0] < "\u4e00"}  # single words
    terms |= {w for w in rng.sample(common, 40) if w[0] >= "\u4e00"}  # CJK words
    terms |= {f"{rng.choice(latin[:400])} {rng.choice(latin[:400])}" for _ in range(20)}  # phrases
    while len(terms) < 100:  # never in the text
        terms.add("".join(rng.choices(LETTERS, k=rng.randint(8, 16))))
    terms = sorted(terms)[:100]

    deltas: list[str] = []
    while len(deltas) < n_deltas:
        word = rng.choices(vocab, weights)[0]
        if word[0] >= "\u4e00":  # CJK: no spaces, one or two characters per delta
            i = 0
            while i < len(word):
                step = rng.randint(1, 2)
                deltas.append(word[i : i + step])
                i += step
        elif len(word) >= 6 and rng.random() < 0.3:  # a long word in two tokens
            cut = rng.randint(2, len(word) - 2)
            deltas += [" " + word[:cut], word[cut:]]
        else:
            deltas.append(" " + word)
        r = rng.random()
        if r < 0.08:
            deltas.append(rng.choice([",", ".", "!", "?", ":"]))
        elif r < 0.10:
            deltas.append(".\n\n")
    return deltas[:n_deltas], terms


def cost_by_delta_size(text: str, terms: list[str], sizes: tuple[int, ...]) -> list[tuple[int, float, float]]:
    """(delta size, median µs per feed, ns per character) for the same text cut into equal deltas."""
    clock = time.perf_counter_ns
    rows = []
    for size in sizes:
        deltas = [text[i : i + size] for i in range(0, min(len(text), 20_000 * size), size)]
        redactor = Redactor(terms)
        times = []
        for d in deltas:
            t0 = clock()
            redactor.feed(d)
            times.append(clock() - t0)
        median = statistics.median(times)
        rows.append((size, median / 1000, median / size))
    return rows


def percentile(sorted_values: list[float], p: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(p / 100 * len(sorted_values)))]


def time_per_delta(deltas: list[str], terms: list[str], rounds: int) -> dict[str, list[float]]:
    clock = time.perf_counter_ns
    samples: dict[str, list[float]] = {"none": [], "guard": [], "feed": []}
    for _ in range(rounds):  # interleaved, so drift in machine speed hits every column alike
        for d in deltas:
            t0 = clock()
            frame(d)
            samples["none"].append((clock() - t0) / 1000)

        redactor = Redactor(terms)
        for d in deltas:
            t0 = clock()
            out = redactor.feed(d)
            if out:
                frame(out)
            samples["guard"].append((clock() - t0) / 1000)
        redactor.flush()

        redactor = Redactor(terms)
        feed = redactor.feed
        for d in deltas:
            t0 = clock()
            feed(d)
            samples["feed"].append((clock() - t0) / 1000)
        redactor.flush()
    return samples


CANNOT = "nothing held, first character cannot begin a term"
CAN = "nothing held, first character can begin a term"
HELD = "text held from earlier deltas"


def waits(deltas: list[str], terms: list[str]) -> tuple[dict[str, list[int]], list[int]]:
    """For each non-empty delta: how many later deltas arrive before its first character is
    released (0 = released by the same feed), grouped by what the guard could know when it came;
    and the same for its last character (0 = the whole delta released by its own feed)."""
    redactor = Redactor(terms)
    starts = {t[0] for t in terms}
    released_upto: list[int] = []  # after feed j: how many input characters are released
    marks: list[tuple[int, int, int, str]] = []  # (delta, position of first char, of last char, group)
    seen = 0
    for i, d in enumerate(deltas):
        if d:
            group = HELD if redactor.held else CAN if d[0] in starts else CANNOT
            marks.append((i, seen, seen + len(d) - 1, group))
        redactor.feed(d)
        seen += len(d)
        released_upto.append(seen - redactor.held)

    def wait(i: int, pos: int) -> int:
        j = i
        while j < len(deltas) and released_upto[j] <= pos:
            j += 1
        return j - i  # j == len(deltas): released by flush

    first: dict[str, list[int]] = {CANNOT: [], CAN: [], HELD: []}
    last: list[int] = []
    for i, pos, end, group in marks:
        first[group].append(wait(i, pos))
        last.append(wait(i, end))
    return first, last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deltas", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    started = time.perf_counter()
    deltas, terms = make_corpus(random.Random(args.seed), args.deltas)
    text = "".join(deltas)

    # Correctness on this corpus first: streamed == whole-text definition.
    redactor = Redactor(terms)
    streamed = "".join(redactor.feed(d) for d in deltas) + redactor.flush()
    redacted = streamed.count("[redacted]")
    assert streamed == redact_whole(text, terms), "streamed output differs from the definition"

    samples = time_per_delta(deltas, terms, args.rounds)
    first, last = waits(deltas, terms)

    mean_len = len(text) / len(deltas)
    print(
        f"## Output guard: {len(deltas):,} deltas ({mean_len:.1f} characters on average, "
        f"{sum(c >= chr(0x4E00) for c in text) / len(text):.0%} CJK), {len(terms)} blocked terms "
        f"(longest {max(map(len, terms))}), {redacted} redactions, {args.rounds} rounds, "
        f"Python {sys.version.split()[0]}\n"
    )
    print("| per delta | median µs | p99 µs | mean µs |")
    print("|---|---:|---:|---:|")
    for name, label in [
        ("none", "no guard (SSE frame only)"),
        ("guard", "guard + SSE frame"),
        ("feed", "guard `feed` alone"),
    ]:
        values = sorted(samples[name])
        print(
            f"| {label} | {statistics.median(values):.2f} | {percentile(values, 99):.2f} | "
            f"{statistics.fmean(values):.2f} |"
        )
    added = statistics.median(samples["guard"]) - statistics.median(samples["none"])
    feed = samples["feed"][: len(deltas)]
    early, late = statistics.median(feed[:2000]), statistics.median(feed[-2000:])
    print(
        f"\nAdded by the guard: {added:.2f} µs per delta (median). `feed`, first 2,000 deltas of the "
        f"stream vs last 2,000: {early:.2f} vs {late:.2f} µs (no growth with the text so far).\n"
    )

    print("| same text, equal deltas of | median µs per feed | ns per character |")
    print("|---:|---:|---:|")
    for size, per_feed, per_char in cost_by_delta_size(text, terms, (1, 4, 16, 64, 256)):
        print(f"| {size} characters | {per_feed:.2f} | {per_char:.0f} |")
    print()

    def row(label: str, values: list[int]) -> str:
        if not values:
            return f"| {label} | 0 | – | – |"
        values = sorted(values)
        same = sum(v == 0 for v in values) / len(values)
        return (
            f"| {label} | {len(values):,} | {same:.1%} | "
            f"{statistics.median(values):g} / {percentile(values, 99):g} / {values[-1]} |"
        )

    print("| non-empty deltas | count | released by their own feed | later deltas waited: median / p99 / max |")
    print("|---|---:|---:|---:|")
    for group, values in first.items():
        print(row(f"first character; {group}", values))
    print(row("last character (the whole delta out)", last))
    print(
        "\nA wait of 0 deltas adds only the `feed` time above; a wait of k deltas adds k upstream "
        "inter-token gaps (the text is held because the next delta decides whether it is redacted)."
    )
    print(f"\n_run time {time.perf_counter() - started:.1f} s_")

    assert not any(first[CANNOT]), "a delta that could not begin a term was held back"


if __name__ == "__main__":
    main()
