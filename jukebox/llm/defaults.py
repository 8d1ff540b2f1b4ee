"""What a booth needs of the LLM proxy before its agent calls a model, with nothing imported.

Every booth starts the proxy's standby (jukebox.llm.session), most of them for agents that never
call a model: the recorder (its scrubbers, the tape's frames) and the price table (tomllib,
decimal, the catalogue's classes) are imported when the proxy starts, not for these constants.
A booth asks at its start whether a price file is named, to read (and check) it then."""

from __future__ import annotations

import os
from collections.abc import Mapping

# What one proxy records in all (request and response bodies) when nobody set a limit: the
# booth passes its --max-scratch instead.
DEFAULT_RECORD_LIMIT = 1024 * 1024 * 1024
PRICES_ENV = "JUKEBOX_PRICES"
TAPE_DIR_FILE = "prices.toml"


def named_price_files(
    tape_dir: str | os.PathLike[str] | None, environ: Mapping[str, str]
) -> list[str]:
    """The files PriceTable.load reads, in its order: `prices.toml` in the tape dir when it is
    a file, then whatever `$JUKEBOX_PRICES` names (a missing one is an error there)."""
    out = []
    if tape_dir is not None and os.path.isfile(os.path.join(tape_dir, TAPE_DIR_FILE)):
        out.append(os.path.join(tape_dir, TAPE_DIR_FILE))
    if environ.get(PRICES_ENV):
        out.append(environ[PRICES_ENV])
    return out
