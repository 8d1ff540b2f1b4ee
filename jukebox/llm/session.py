"""The proxy as one booth uses it: started with the booth, recording onto its tape, and, under
`--net none`, listening inside the agent's private network.

`LlmOptions` is what a caller of `run_booth` chooses: record (the default), replay from a tape,
fork overrides, a circuit breaker. The booth supplies the tape writer and the trip callback.

Every booth starts a session, most of them for agents that never call a model: this module
imports only what the standby proxy needs (jukebox.llm.standby); the price table, the recorder,
the private network and the lookups' watch are imported when used (the price table by the
proxy's start, unless a price file is named, which is read, and so checked, at once).
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Mapping

from jukebox.llm.defaults import named_price_files
from jukebox.llm.providers import OPENAI
from jukebox.llm.standby import Standby
from jukebox.llm.telemetry import environment_warnings
from jukebox.llm.upstreams import NOTE_EVENT as UPSTREAMS_NOTE
from jukebox.llm.upstreams import resolve, upstreams_from_env
from shadowfs.values import Record

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start's cost)
if TYPE_CHECKING:
    from typing import Any, TypeVar

    from jukebox.llm.lookups import LookupWatch
    from jukebox.llm.netns import PrivateNetwork
    from jukebox.llm.recorder import FrameSink
    from jukebox.llm.replay import Divergence, ReplaySource
    from jukebox.llm.rewrite import RequestRewriter

    T = TypeVar("T")


class LlmOptions(Record):
    FIELDS = ("replay", "rewriter", "breaker", "upstreams", "on_divergence")
    replay: ReplaySource | None
    rewriter: RequestRewriter | None
    breaker: Any  # jukebox.guard.breaker.CircuitBreaker or anything with admit()/observe()
    # Default: upstreams_from_env (the user's *_BASE_URL, else public; `azure` from
    # AZURE_OPENAI_ENDPOINT); named upstreams are more keys (jukebox.llm.upstreams).
    upstreams: Mapping[str, str] | None
    on_divergence: Callable[[Divergence], Any] | None

    def __init__(
        self,
        replay: ReplaySource | None = None,
        rewriter: RequestRewriter | None = None,
        breaker: Any = None,
        upstreams: Mapping[str, str] | None = None,
        on_divergence: Callable[[Divergence], Any] | None = None,
    ) -> None:
        self.replay = replay
        self.rewriter = rewriter
        self.breaker = breaker
        self.upstreams = upstreams
        self.on_divergence = on_divergence


class LlmSession:
    def __init__(
        self,
        proxy: Standby,
        network: PrivateNetwork | None,
        replaying: bool = False,
        lookups: LookupWatch | None = None,
    ) -> None:
        self.proxy = proxy
        self.network = network
        self.replaying = replaying
        self.lookups = lookups

    @classmethod
    def start(
        cls,
        *,
        record: FrameSink,
        environ: Mapping[str, str],
        secrets: list[str],
        tape_dir: str | os.PathLike[str] | None,
        private_network: bool,
        options: LlmOptions | None = None,
        on_trip: Callable[[Any], Any] | None = None,
        record_limit: int | None = None,
        stop_agent: Callable[[Any], Any] | None = None,
        scrubber: Any = None,
    ) -> LlmSession:
        """`record_limit`: the bytes of model traffic the proxy may record (the booth's
        --max-scratch; DEFAULT_RECORD_LIMIT when None). `on_trip` records a trip at once;
        `stop_agent` is called after the agent has been told why (see ProxyServer).
        `scrubber` (a jukebox.redact.Scrubber, the booth's): what the agent's lookups under
        --net none show of a name passes it."""
        options = options or LlmOptions()
        replay = options.replay
        upstreams = options.upstreams or upstreams_from_env(environ)
        # Checked now (a bad name, a bad price file): the agent must not start with a proxy
        # that cannot.
        _, protocols = resolve(upstreams, replay.upstream_protocols if replay else None)
        prices: Any = None  # no file named: the proxy's default, the catalogue alone
        if named_price_files(tape_dir, environ):
            from jukebox.llm.pricing import PriceTable

            prices = PriceTable.load(tape_dir, environ)

        def make(sock: socket.socket, secret: str, learned: list[str]) -> Any:
            # Here, at the first connection: the proxy's imports are most of a booth's start.
            from jukebox.llm.server import ProxyServer

            return ProxyServer(
                upstreams=upstreams,
                record=record,
                record_inline=True,  # the booth's GroupTape writes; its group commit syncs
                spin=True,  # in the supervisor, apart from the agent: no GIL to fight for
                replay=replay,
                rewriter=options.rewriter,
                breaker=options.breaker,
                on_trip=on_trip,
                stop_agent=stop_agent,
                on_divergence=options.on_divergence,
                secrets=[*secrets, *learned],
                prices=prices,
                sock=sock,
                secret=secret,
                record_limit=record_limit,
            )

        network = None
        if private_network:
            from jukebox.llm.netns import PrivateNetwork

            network = PrivateNetwork()
        try:
            sock = network.listen() if network is not None else None
            proxy = Standby(make, protocols, sock=sock).start()
        except BaseException:
            if network is not None:
                network.close()
            raise
        try:
            if proxy.named:
                # The names the agent was given: its replay gets the same (jukebox.llm.upstreams).
                note: dict[str, Any] = {"event": UPSTREAMS_NOTE, "names": proxy.named}
                other = {n: p for n, p in proxy.protocols.items() if p != OPENAI}
                if other:
                    note["protocols"] = other
                record("note", note)
            # What the agent tries to reach around the proxy, seen by its lookups.
            lookups = None
            if network is not None:
                from jukebox.llm.lookups import LookupWatch

                lookups = LookupWatch.start(network, record, scrubber)
        except BaseException:
            proxy.stop()
            if network is not None:
                network.close()
            raise
        return cls(proxy, network, replaying=replay is not None, lookups=lookups)

    def agent_env(self, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """What the agent's environment `env` gets: the base URLs, with the proxy's secret (for
        the agent only), and in a replay a placeholder for each API key `env` lacks."""
        out = self.proxy.base_urls()
        self.proxy.agent_environ = dict(env or {})
        # Senders the proxy cannot see: said before the agent starts (jukebox.llm.telemetry).
        for line in environment_warnings(env or {}, offline=self.network is not None):
            print(f"jukebox: {line}", file=sys.stderr, flush=True)
        if self.replaying:
            from jukebox.llm.placeholder_keys import placeholder_env

            out.update(placeholder_env(env or {}))
        return out

    def add_secrets(self, values: list[str]) -> None:
        """More values the proxy scrubs from what it records (another gateway's path secret,
        made after the proxy's session)."""
        self.proxy.add_secrets(values)

    def spawn(self, spawn: Callable[[Any], T], spec: Any) -> T:
        """Starts the agent with `spawn(spec)`, inside the private network when there is one
        (the spec then says `host`: the shim must not make yet another, empty, namespace)."""
        if self.network is None:
            return spawn(spec)
        return self.network.call(spawn, spec.replace(net="host"))

    def close(self) -> None:
        if self.lookups is not None:
            self.lookups.close()
        self.proxy.stop()
        if self.network is not None:
            self.network.close()
