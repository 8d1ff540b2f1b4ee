"""One private PostgreSQL cluster for all of tests/sql (see tests/sql/cluster.py); each test
gets a fresh database in it."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from tests.sql.cluster import Cluster, bindir

_names = itertools.count(1)


# Package-scoped, not session: under `pytest -n` the tests using it then run on one worker
# (tests/conftest.py), which starts one cluster instead of one per worker.
@pytest.fixture(scope="package")
def pg() -> Iterator[Cluster]:
    where = bindir()
    if where is None:
        pytest.fail("PostgreSQL is not installed: `make setup` installs Debian's postgresql")
    cluster = Cluster(where)
    try:
        cluster.init()
        yield cluster
    finally:
        cluster.remove()


@pytest.fixture
def db(pg: Cluster) -> str:
    """A fresh database's name, with a table `t(id int primary key, v text)` holding 1 and 2."""
    name = f"d{next(_names)}"
    pg.psql(f"CREATE DATABASE {name}")
    pg.psql("CREATE TABLE t (id int PRIMARY KEY, v text); INSERT INTO t VALUES (1, 'one'), "
            "(2, 'two')", db=name)
    return name
