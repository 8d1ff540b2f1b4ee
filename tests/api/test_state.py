"""The versioned agent memory: a persistent map with structural sharing, hashed into the store."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from jukebox.api.state import FrozenDict, FrozenList, State, StateVersion, freeze, thaw
from shadowfs.store import Store


class CountingStore(Store):
    """A real store that counts the objects it is asked to put."""

    puts = 0

    def put(self, kind, data, delta_base=None):  # type: ignore[no-untyped-def, override]
        self.puts += 1
        return super().put(kind, data, delta_base)


@pytest.fixture
def store(tmp_path: Path):  # type: ignore[no-untyped-def]
    s = CountingStore.open(tmp_path / "store")
    yield s
    s.close()


def test_matches_a_dict_through_random_changes() -> None:
    rnd = random.Random(7)
    model: dict[str, int] = {}
    v = StateVersion()
    for _ in range(4000):
        key = f"k{rnd.randrange(600)}"
        if rnd.random() < 0.3:
            model.pop(key, None)
            v = v.delete(key)
        else:
            model[key] = rnd.randrange(4)
            v = v.set(key, model[key])
        assert len(v) == len(model)
    assert dict(v.items()) == model
    assert sorted(v) == sorted(model)
    assert all(v[k] == model[k] for k in model)
    assert "absent" not in v and v.get("absent", 5) == 5
    with pytest.raises(KeyError):
        v["absent"]


def test_equal_contents_have_equal_ids_whatever_the_history(store: Store) -> None:
    keys = [f"key-{i}" for i in range(500)]
    a = StateVersion.from_mapping({k: i for i, k in enumerate(keys)})
    shuffled = keys[:]
    random.Random(1).shuffle(shuffled)
    b = StateVersion()
    for k in [*shuffled, "extra-1", "extra-2"]:
        b = b.set(k, -1)
    for k in shuffled:
        b = b.set(k, keys.index(k))
    b = b.delete("extra-1").delete("extra-2")
    assert a == b
    assert a.save(store) == b.save(store)


def test_a_change_shares_all_but_its_path(store: Store) -> None:
    v = StateVersion.from_mapping({f"key{i}": {"n": i} for i in range(1000)})
    first = v.save(store)
    before = store.puts
    w = v.set("key17", {"n": -17})
    second = w.save(store)
    assert second != first
    # Only the nodes on the changed key's path are new (the trie is 2-3 levels deep here).
    assert 1 <= store.puts - before <= 4
    assert v.save(store) == first and store.puts - before <= 4  # saved versions cost nothing
    loaded = StateVersion.load(store, second.hex())
    assert loaded == w and loaded["key17"] == {"n": -17}
    assert v.diff(w) == {"added": [], "removed": [], "changed": ["key17"]}
    assert w.diff(w.delete("key3").set("new", 1)) == {
        "added": ["new"], "removed": ["key3"], "changed": []
    }


def test_hash_collisions_are_handled(monkeypatch: pytest.MonkeyPatch, store: Store) -> None:
    import jukebox.api.state as st

    monkeypatch.setattr(st, "_hash", lambda key: len(key) & 3)  # everything collides
    v = StateVersion.from_mapping({f"k{i}": i for i in range(50)})
    assert len(v) == 50 and v["k42"] == 42
    v = v.delete("k42").set("k7", "seven")
    assert "k42" not in v and v["k7"] == "seven" and len(v) == 49
    assert StateVersion.load(store, v.save(store)) == v


def test_values_are_frozen_json_like_data() -> None:
    s = State()
    plan = {"steps": ["read", "write"], "meta": {"retries": 2}}
    s["plan"] = plan
    plan["steps"].append("mutated later")  # the caller's object is not shared
    got = s["plan"]
    assert got == {"steps": ["read", "write"], "meta": {"retries": 2}}
    assert isinstance(got, FrozenDict) and isinstance(got["steps"], FrozenList)
    with pytest.raises(TypeError, match="immutable"):
        got["steps"].append("x")
    with pytest.raises(TypeError, match="immutable"):
        got["meta"]["retries"] = 3
    assert thaw(got) == plan | {"steps": ["read", "write"]}
    assert json.loads(json.dumps(got)) == {"steps": ["read", "write"], "meta": {"retries": 2}}
    with pytest.raises(TypeError, match="JSON-like"):
        s["bad"] = object()
    with pytest.raises(ValueError, match="finite"):
        s["nan"] = float("nan")
    with pytest.raises(TypeError, match="keys must be strings"):
        freeze({1: "x"})
    # 1, True and 1.0 are different JSON values.
    s["x"] = 1
    s["x"] = True
    assert s["x"] is True


def test_restore_is_a_pointer_swap() -> None:
    s = State({"a": 1})
    kept = s.version
    s.update({"b": 2}, c=3)
    del s["a"]
    assert s.to_dict() == {"b": 2, "c": 3}
    s.restore(kept)
    assert s.version is kept and s.to_dict() == {"a": 1}
    unchanged = s.version
    s.set("a", 1)  # setting an equal value makes no new version
    assert s.version is unchanged
    with pytest.raises(KeyError):
        del s["zzz"]
    with pytest.raises(TypeError, match="StateVersion"):
        s.restore({"a": 1})  # type: ignore[arg-type]
