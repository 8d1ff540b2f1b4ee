"""shadowfs.bounded.BoundedMap: oldest entries go first, by count or by total weight."""

from __future__ import annotations

from shadowfs.bounded import BoundedMap


def test_the_oldest_entries_go_past_the_count_or_the_weight() -> None:
    m: BoundedMap[str, int] = BoundedMap(3, 10)
    for key in "abc":
        m.put(key, ord(key), 1)
    m.put("d", 0, 1)  # four entries: "a" goes
    assert "a" not in m and all(k in m for k in "bcd")
    m.put("e", 5, 8)  # weight 1 + 1 + 1 + 8 > 10: "b" goes, which brings it to 10
    assert "b" not in m and "c" in m and m["d"] == 0 and m.get("e") == 5
    m.put("f", 6, 1)  # 11 again (and four entries): "c" goes
    assert "c" not in m and all(k in m for k in "def")


def test_put_again_makes_a_key_the_newest_and_replaces_its_weight() -> None:
    m: BoundedMap[str, str] = BoundedMap(None, 4)
    m.put("a", "first", 2)
    m.put("b", "b", 2)
    m.put("a", "second", 1)  # now newest, weight 1: total 3
    m.put("c", "c", 1)  # total 4: nothing goes
    assert m.get("a") == "second" and "b" in m and "c" in m
    m.put("d", "d", 1)  # total 5: the oldest, "b", goes
    assert "b" not in m and "a" in m


def test_the_newest_entry_stays_however_heavy() -> None:
    m: BoundedMap[str, int] = BoundedMap(None, 4)
    m.put("a", 1, 1)
    m.put("big", 2, 100)
    assert "a" not in m and m["big"] == 2


def test_clear_forgets_every_entry_and_its_weight() -> None:
    m: BoundedMap[str, int] = BoundedMap(None, 4)
    m.put("a", 1, 3)
    m.clear()
    assert "a" not in m and m.get("a") is None
    m.put("b", 2, 2)
    m.put("c", 3, 2)  # 4 in all: had "a"'s weight stayed counted, "b" would go
    assert m["b"] == 2 and m["c"] == 3
