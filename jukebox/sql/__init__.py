"""The SQL savepoint proxy: an agent's PostgreSQL work runs inside one transaction per booth
database and commits or vanishes with the booth's files (docs/sql.md)."""
