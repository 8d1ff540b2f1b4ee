"""Near-duplicate detection for agent outputs: hashed n-gram vectors and their cosine similarity.

No model, no download, no numpy: a text becomes a sparse vector of hashed n-grams, and two
outputs are near-duplicates when the cosine of their vectors reaches a threshold. The circuit
breaker (`jukebox.guard.breaker`) compares each model output with the one before it.

Features
--------
A **text** is lower-cased and split into word tokens (`\\w+`, Unicode-aware); function words and
an agent's filler ("let me", "now I'll try again", "the", "to" ... see `STOPWORDS`) are dropped,
because rewordings of one step differ mostly in those (a text of filler only keeps them all).
Its vector is the sum of two parts, each scaled to unit length and weighted equally, so the
cosine of two texts is about the mean of the two parts' cosines:

* words: the remaining words, counted (order-free, so an inserted "again" or a moved clause
  costs little);
* chars: character 3-grams of the remaining words joined by single spaces — the whole of it up
  to 2,048 characters, else its first and last 1,024 (long texts are told apart by their words
  already; the cap keeps a 10 KB output near a millisecond). They keep "module_1.py" and
  "module_2.py" close without making them equal, and catch small spelling changes.

Digits are kept as they are: "processing item 1" and "processing item 2" differ (about 0.8),
because a run that walks through numbered items is making progress, and a false trip kills a
working agent. Measured on rewordings an agent loop produces ("I need to read the file
src/app.py to understand the bug" / "I need to read src/app.py to understand the bug ... again"):
0.93 to 1.0; on successive steps of a run that progresses: 0.0 to 0.8.

A **tool call** (OpenAI `{"function": {"name", "arguments"}}`, Anthropic `{"name", "input"}` or a
plain `{"name", "arguments"|"args"|"input"}`; ids are ignored, JSON-string arguments are parsed)
has two parts, weighted equally when both exist:

* exact: one feature for the name plus the canonical JSON of every argument except long strings,
  so `read_file(path="a.py")` and `read_file(path="b.py")` share nothing there;
* text: the text vector of each string argument longer than 64 characters (file contents,
  scripts, long queries), keyed by its argument path, so a rewrite that changes one line of a
  2 KB file is still near its previous version.

Hence the same call with the same arguments has similarity 1.0, and the same call on a different
file has similarity 0.0 (exact part only) or at most 0.5 (when its long arguments are equal).

An **output** — one model response — joins its text and its tool calls (each call unit-scaled,
summed, then scaled to unit length) in equal weights. An output with neither has no vector.

Hashing is `zlib.crc32` of the UTF-8 feature, seeded with a short namespace ("w", "c", "x",
plus the argument path for long tool arguments): deterministic in every process (Python's own
`hash()` of a string is salted per process) and one C call per distinct feature. The buckets are
the full 32 bits (`DIM = 2**32`) rather than 2**12..2**16: vectors are sparse `dict[int, float]`,
so the dimension costs nothing, while 16 bits would make a 10 KB text's ~2,000 features collide
a few dozen times (CRC-32 is even collision-free on inputs of 4 bytes or less, so ASCII 3-grams
never share a bucket). Features that do collide add up. Vectors are unit length, built once and
never mutated, so a caller can keep one by reference.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import zlib
from collections import Counter
from collections.abc import Mapping, Sequence
from itertools import repeat
from operator import mul
from typing import Any

DIM_BITS = 32  # CRC-32 values as they come: sparse vectors make a large dimension free
DIM = 1 << DIM_BITS
CHAR_GRAM = 3
CHAR_WINDOW = 1024  # characters kept from each end of a long text for its char 3-grams
LONG_ARG = 64  # string arguments longer than this are compared as text, not exactly

Vector = dict[int, float]

_WORD = re.compile(r"\w+")
_HALF = math.sqrt(0.5)  # the length of each of two equal parts of a unit vector

# Function words and an agent's filler ("let me", "now I'll try again"): rewordings of one step
# differ mostly in these, so they are left out of the features.
_STOPWORD_TEXT = """
    a an the and or but if then so to of in on at by for with from as into onto about over
    under up out i me my we us our you your he she it its they them their this that these those
    there here is are was were be been being am do does did doing have has had having will would
    shall should can could may might must ll ve re s t d m let lets now just again also too very
    still what which who whom whose when where why how whether not no yes ok okay because since
    while after before first next once each all any some more most other such only own same both
    few further try trying going gonna want need see look check like sure think"""
STOPWORDS = frozenset(_STOPWORD_TEXT.split())


def _hashed(counts: Mapping[str, float], prefix: str, scale: float) -> Vector:
    """Counted features as a vector of length `scale`, each feature's bucket its CRC-32 (seeded
    with the namespace `prefix`); features that share a bucket add up."""
    if not counts:
        return {}
    seed = zlib.crc32(prefix.encode())
    # Whole-list C loops (map, zip, dict) instead of a Python loop per feature: the hot path.
    keys = list(map(zlib.crc32, map(str.encode, counts), repeat(seed, len(counts))))
    values = list(counts.values())
    norm = math.sqrt(sum(map(mul, values, values)))
    factor = scale / norm
    out = dict(zip(keys, [v * factor for v in values], strict=True))
    if len(out) == len(keys):
        return out
    merged: dict[int, float] = {}
    for key, value in zip(keys, values, strict=True):
        merged[key] = merged.get(key, 0.0) + value
    return _scaled(merged, scale)


def _scaled(vec: Vector, scale: float = 1.0) -> Vector:
    norm = math.sqrt(sum(v * v for v in vec.values()))
    if norm == 0.0:
        return {}
    factor = scale / norm
    return {k: v * factor for k, v in vec.items()}


def _join(parts: Sequence[Vector]) -> Vector:
    """The sum of parts built in disjoint namespaces, each already scaled to its share."""
    out: Vector = {}
    total = 0
    for part in parts:
        out.update(part)
        total += len(part)
    if len(out) == total:
        return out
    # Two namespaces met in one bucket (about one feature pair in 2**32): add them up properly.
    summed: Vector = {}
    for part in parts:
        for k, v in part.items():
            summed[k] = summed.get(k, 0.0) + v
    return _scaled(summed)


def _content_words(lowered: str) -> list[str]:
    words = _WORD.findall(lowered)
    content = [w for w in words if w not in STOPWORDS]
    # A text of filler only ("ok, let me do it") still has to look like itself.
    return content or words


def _char_counts(content: list[str]) -> Counter[str]:
    joined = " ".join(content)
    if len(joined) > 2 * CHAR_WINDOW:
        joined = joined[:CHAR_WINDOW] + "\n" + joined[-CHAR_WINDOW:]
    n = len(joined) - CHAR_GRAM + 1
    if n <= 0:
        return Counter([joined])
    return Counter([joined[i : i + CHAR_GRAM] for i in range(n)])


def text_vector(text: str, namespace: str = "", scale: float = 1.0) -> Vector:
    """The vector of a text, of length `scale` (1: a unit vector); `{}` when the text has no
    word characters."""
    content = _content_words(text.lower())
    if not content:
        return {}
    half = scale * _HALF
    return _join(
        [
            _hashed(Counter(content), "w" + namespace, half),
            _hashed(_char_counts(content), "c" + namespace, half),
        ]
    )


def canonical_json(value: Any) -> str:
    """One spelling per JSON value: sorted keys, no spaces, non-ASCII kept as is."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def split_tool_call(call: Mapping[str, Any]) -> tuple[str, Any]:
    """(name, arguments) of a tool call in the OpenAI, Anthropic or plain shape; ids dropped."""
    fn = call.get("function")
    if isinstance(fn, Mapping):
        name, args = fn.get("name"), fn.get("arguments")
    else:
        name = call.get("name")
        args = next((call[k] for k in ("arguments", "args", "input") if k in call), None)
    if isinstance(args, str):
        # OpenAI sends arguments as a JSON string; parsed, the key order and spacing stop mattering.
        with contextlib.suppress(ValueError):
            args = json.loads(args)
    return str(name or ""), args


def tool_call_signature(call: Mapping[str, Any]) -> str:
    """The exact identity of a call: its name and canonical JSON arguments."""
    name, args = split_tool_call(call)
    return name + " " + canonical_json(args)


def _leaves(value: Any, path: str, exact: dict[str, Any], long: list[tuple[str, str]]) -> None:
    if isinstance(value, Mapping):
        for k in value:
            _leaves(value[k], f"{path}.{k}", exact, long)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _leaves(item, f"{path}[{i}]", exact, long)
    elif isinstance(value, str) and len(value) > LONG_ARG:
        long.append((path, value))
    else:
        exact[path] = value


def tool_call_vector(call: Mapping[str, Any], scale: float = 1.0) -> Vector:
    """The vector of one tool call, of length `scale` (see the module docstring for its parts)."""
    name, args = split_tool_call(call)
    exact: dict[str, Any] = {}
    long: list[tuple[str, str]] = []
    _leaves(args, "", exact, long)
    long = [(path, text) for path, text in long if _WORD.search(text)]  # punctuation: no vector
    signature = {name + " " + canonical_json(exact): 1.0}
    if not long:
        return _hashed(signature, "x", scale)
    share = scale * _HALF / math.sqrt(len(long))
    return _join(
        [_hashed(signature, "x", scale * _HALF)]
        + [text_vector(text, name + path, share) for path, text in long]
    )


def output_vector(
    text: str | None, tool_calls: Sequence[Mapping[str, Any]] | None = None
) -> Vector:
    """The unit vector of one model output: its text and its tool calls; `{}` when it has none."""
    text_vec = text_vector(text, "", _HALF if tool_calls else 1.0) if text else {}
    if not tool_calls:
        return text_vec
    scale = _HALF if text_vec else 1.0
    if len(tool_calls) == 1:
        calls = tool_call_vector(tool_calls[0], scale)
    else:
        # Calls in one output may repeat each other, so their sum is scaled as a whole.
        summed: Vector = {}
        for call in tool_calls:
            for k, v in tool_call_vector(call).items():
                summed[k] = summed.get(k, 0.0) + v
        calls = _scaled(summed, scale)
    if not text_vec:
        return calls
    return _join([text_vec, calls])


def cosine(a: Vector, b: Vector) -> float:
    """Cosine similarity of two unit vectors from this module; 0.0 when either is empty."""
    if len(a) > len(b):
        a, b = b, a
    get = b.get
    dot = sum(v * get(k, 0.0) for k, v in a.items())
    # Rounding can push identical vectors a hair past 1.
    return min(1.0, dot)


def similarity(a: str, b: str) -> float:
    """Cosine similarity of two texts."""
    return cosine(text_vector(a), text_vector(b))
