"""The circuit breaker: stops runaway cost, tokens, turns and semantic loops.

One `CircuitBreaker` watches one run. The booth's LLM proxy calls `admit()` before it forwards a
model call and `observe(...)` after each exchange; the Python API calls `check(...)` for each
recorded turn. When a rule trips, the breaker holds a `Trip` (the rule, its limit, the value that
broke it, one sentence for a human) and stays tripped until `reset()`.

Counting, exactly
-----------------
Every `observe()` call is one turn: one model exchange, or one turn recorded through the API.
Limits are inclusive — a run may use exactly its budget:

* `max_cost_usd`: trips in the `observe()` that brings the total cost above the limit. Costs
  add up in integer nano-dollars, so 0.1 + 0.1 + 0.1 is exactly 0.3 and does not trip 0.3.
  `admit()` trips once the total has reached the limit: the next call could only exceed it;
  and, given the call's worst case (a `Reservation`), when the total plus every reservation
  held plus this one would exceed it.
* `max_tokens`: the same with the token total.
* `max_turns`: `observe()` trips on turn `max_turns + 1`; `admit()` trips before it, when
  `max_turns` turns are done or in flight (the reported value is the turn that would have
  started).

An admitted reservation is held until `observe(..., reservation=)` or `release()` settles it,
so calls in flight together are counted against the limits before they are forwarded.
`observe(..., retry=True)` is an attempt repeating a request whose answer was retryable (an
SDK's retry): when it fails again it adds no turn and steps neither repeat rule, since the
first attempt counted that failure; a retry that succeeds counts like any turn.
* `max_semantic_repeat` (alias `max_repeat`, the CLI's name), N >= 2: the *repeat run* is the
  number of consecutive outputs each near-duplicate of the one before it — cosine similarity of
  their hashed n-gram vectors (`jukebox.guard.similarity`) at least `similarity_threshold`. The
  first output makes the run 1, a near-duplicate of it 2, and so on; an output that is not a
  near-duplicate starts a new run at 1. The rule trips when the run reaches N: with N = 3, the
  third output in a row that says the same thing (or makes the same tool call with the same
  arguments) trips. A turn with neither text nor tool calls (a cost-only record) leaves the run
  as it is. An output is its text and its tool calls together (see `jukebox.guard.similarity`).
* `max_repeat_failures`, N >= 2: the *failure run* counts consecutive turns whose `failed`
  error is the same as the one before, for the same call. The call is the turn's own tool calls
  if it has any, else the last tool calls seen (a proxy learns that a call failed from the tool
  result in the *next* request). Errors compare after collapsing whitespace and masking hex
  addresses (`0x7f3a...`). `failed=True` is a failure with no error text (all alike), and
  `failed=False` is the same as None; pass the error text when there is one, so that different
  failures are told apart. A turn without `failed` ends the run; a different error or call
  starts a new run at 1. The rule trips when the run reaches N. The CLI's `--max-repeat N` sets
  both repeat rules to N.

When several rules break in one turn, the first in the order above is reported. Once tripped,
`admit()`, `observe()` and `check()` keep returning (or raising) that trip; `observe()` still
adds what it is told to the totals, because that spend really happened.

`state()` and `restore()` are O(1) (a tuple of immutable values; the last output's vector is
built once and never mutated) so a transaction can snapshot the breaker with its checkpoints.
By default `restore()` rewinds only what describes the conversation — the repeat and failure
runs and the last output — and keeps what was spent (cost, tokens, turns) and a standing trip:
rolling files back refunds no API bill, and a run that loops through rollbacks must still hit
its budget. `restore(state, spend=True)` rewinds everything, the trip included.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeGuard

from jukebox.errors import CheckFailed, UsageError
from jukebox.guard.similarity import Vector, cosine, output_vector, tool_call_signature

RULES = ("max_cost_usd", "max_tokens", "max_turns", "max_semantic_repeat", "max_repeat_failures")
NANO = 1_000_000_000  # costs are summed in integer nano-dollars: no float drift over many turns
_HEX_ADDR = re.compile(r"0x[0-9a-fA-F]+")
_SPACE = re.compile(r"\s+")
_ERROR_KEEP = 500  # characters of a normalized error kept for comparing and for the detail

# The CLI spelling of each limit, for error messages that tell a user what to change.
FLAGS = {
    "max_cost_usd": "--max-cost-usd",
    "max_tokens": "--max-tokens",
    "max_turns": "--max-turns",
    "max_semantic_repeat": "--max-repeat",
    "max_repeat_failures": "--max-repeat",
}


@dataclass(frozen=True)
class Trip:
    """Why the breaker tripped: which rule, its limit, the value that broke it, and a sentence."""

    rule: str
    limit: float | int
    value: float | int
    detail: str

    def to_payload(self) -> dict[str, Any]:
        """The `breaker` frame's payload."""
        return {"rule": self.rule, "limit": self.limit, "value": self.value, "detail": self.detail}


@dataclass
class Reservation:
    """The worst case of one model call, held by `admit()` until the call is settled."""

    tokens: int = 0
    cost_nano: int = 0
    held: bool = False

    @classmethod
    def of(cls, tokens: int, cost_usd: float) -> Reservation:
        return cls(max(int(tokens), 0), max(round(cost_usd * NANO), 0))


class BreakerTripped(CheckFailed):
    """Raised by `CircuitBreaker.check()` (and so by the Python API) when a rule has tripped."""

    def __init__(self, trip: Trip) -> None:
        self.trip = trip
        super().__init__(f"circuit breaker tripped on {trip.rule}: {trip.detail}")


class BreakerState(NamedTuple):
    """A snapshot from `CircuitBreaker.state()`; opaque to callers, immutable."""

    cost_nano: int
    tokens: int
    turns: int
    repeat_run: int
    last_key: Any
    last_vector: Vector | None
    fail_key: Any
    fail_run: int
    last_calls: str | None
    tripped: Trip | None


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_limit(name: str, value: object, *, minimum: int, money: bool = False) -> None:
    """ValueError naming the parameter and the valid range unless `value` is a valid limit."""
    if value is None:
        return
    if money:
        ok = (_is_int(value) or isinstance(value, float)) and math.isfinite(value) and value > 0
        if not ok:
            raise ValueError(
                f"{name} must be a positive number of US dollars (e.g. 0.50), not {value!r}"
            )
    elif not _is_int(value) or value < minimum:
        raise ValueError(f"{name} must be a whole number >= {minimum}, not {value!r}")


def _check_unknown_cost(name: str, value: object) -> None:
    """ValueError unless `value` is deny, warn or price=IN/OUT (dollars per million tokens)."""
    from jukebox.llm.pricing import per_million

    if value in ("deny", "warn"):
        return
    if isinstance(value, str) and value.startswith("price="):
        try:
            per_million(value.removeprefix("price="))
            return
        except ValueError:
            pass
    raise ValueError(
        f"{name} must be deny, warn or price=IN/OUT (US dollars per million input and output "
        f"tokens, e.g. price=3/15), not {value!r}"
    )


def _normalize_error(error: str) -> str:
    return _HEX_ADDR.sub("0x?", _SPACE.sub(" ", error).strip())[:_ERROR_KEEP]


def _calls_signature(tool_calls: Sequence[Mapping[str, Any]]) -> str:
    return "\n".join(tool_call_signature(c) for c in tool_calls)


def _fmt_usd(value: float) -> str:
    return f"${value:.4f}" if value < 100 else f"${value:,.2f}"


class CircuitBreaker:
    """Limits on one run; see the module docstring for exactly when each rule trips."""

    # What reset() sets and state()/restore() carry: declared here because reset() sets them.
    _cost_nano: int
    _tokens: int
    _turns: int
    _repeat_run: int
    _last_key: Any
    _last_vector: Vector | None
    _fail_key: Any
    _fail_run: int
    _last_calls: str | None
    _tripped: Trip | None
    _held_turns: int
    _held_tokens: int
    _held_nano: int

    def __init__(
        self,
        max_cost_usd: float | None = None,
        max_tokens: int | None = None,
        max_turns: int | None = None,
        max_semantic_repeat: int | None = None,
        *,
        max_repeat: int | None = None,
        similarity_threshold: float = 0.92,
        max_repeat_failures: int | None = None,
        unknown_cost: str = "warn",
    ) -> None:
        if max_repeat is not None:
            if max_semantic_repeat is not None and max_semantic_repeat != max_repeat:
                raise ValueError(
                    f"max_repeat ({max_repeat!r}) is another name for max_semantic_repeat "
                    f"({max_semantic_repeat!r}): pass only one of them"
                )
            max_semantic_repeat = max_repeat
        _check_limit("max_cost_usd", max_cost_usd, minimum=0, money=True)
        _check_limit("max_tokens", max_tokens, minimum=1)
        _check_limit("max_turns", max_turns, minimum=1)
        _check_limit("max_semantic_repeat", max_semantic_repeat, minimum=2)
        _check_limit("max_repeat_failures", max_repeat_failures, minimum=2)
        if (
            not isinstance(similarity_threshold, int | float)
            or isinstance(similarity_threshold, bool)
            or not 0.0 < similarity_threshold <= 1.0
        ):
            raise ValueError(
                "similarity_threshold must be a number in (0, 1] (1.0: only identical outputs "
                f"repeat), not {similarity_threshold!r}"
            )
        _check_unknown_cost("unknown_cost", unknown_cost)
        self.unknown_cost = unknown_cost
        self.max_cost_usd = float(max_cost_usd) if max_cost_usd is not None else None
        self.max_tokens = max_tokens
        self.max_turns = max_turns
        self.max_semantic_repeat = max_semantic_repeat
        self.max_repeat_failures = max_repeat_failures
        self.similarity_threshold = float(similarity_threshold)
        # The cost limit in nano-dollars, compared with integer totals.
        self._cost_limit = round(max_cost_usd * NANO) if max_cost_usd is not None else None
        self._lock = threading.Lock()
        self.reset()

    @classmethod
    def from_options(
        cls,
        max_cost_usd: float | None = None,
        max_tokens: int | None = None,
        max_turns: int | None = None,
        max_repeat: int | None = None,
        similarity_threshold: float | None = None,
        unknown_cost: str | None = None,
    ) -> CircuitBreaker | None:
        """The breaker `jukebox booth run` flags ask for, or None when no flag is set.

        `--max-repeat N` sets both repeat rules. Bad values raise UsageError naming the flag.
        """
        values = {
            "--max-cost-usd": max_cost_usd,
            "--max-tokens": max_tokens,
            "--max-turns": max_turns,
            "--max-repeat": max_repeat,
        }
        if all(v is None for v in values.values()) and unknown_cost is None:
            return None
        try:
            _check_limit("--max-cost-usd", max_cost_usd, minimum=0, money=True)
            _check_limit("--max-tokens", max_tokens, minimum=1)
            _check_limit("--max-turns", max_turns, minimum=1)
            _check_limit("--max-repeat", max_repeat, minimum=2)
            if unknown_cost is not None:
                _check_unknown_cost("--unknown-cost", unknown_cost)
            extra: dict[str, Any] = {}
            if similarity_threshold is not None:
                extra["similarity_threshold"] = similarity_threshold
            if unknown_cost is not None:
                extra["unknown_cost"] = unknown_cost
            return cls(
                max_cost_usd=max_cost_usd,
                max_tokens=max_tokens,
                max_turns=max_turns,
                max_semantic_repeat=max_repeat,
                max_repeat_failures=max_repeat,
                **extra,
            )
        except ValueError as error:
            raise UsageError(str(error)) from None

    # ------------------------------------------------------------------ what callers read

    @property
    def tripped(self) -> Trip | None:
        return self._tripped

    @property
    def totals(self) -> dict[str, Any]:
        """What the run has used so far, for `status` and frames."""
        return {
            "cost_usd": self._cost_nano / NANO,
            "tokens": self._tokens,
            "turns": self._turns,
            "repeat_run": self._repeat_run,
            "failure_run": self._fail_run,
        }

    @property
    def limits(self) -> dict[str, Any]:
        """The configured limits (None: no limit), for a run_start frame's policy."""
        return {
            "max_cost_usd": self.max_cost_usd,
            "max_tokens": self.max_tokens,
            "max_turns": self.max_turns,
            "max_semantic_repeat": self.max_semantic_repeat,
            "max_repeat_failures": self.max_repeat_failures,
            "similarity_threshold": self.similarity_threshold,
            "unknown_cost": self.unknown_cost,
        }

    def __repr__(self) -> str:
        set_limits = ", ".join(f"{k}={v!r}" for k, v in self.limits.items() if v is not None)
        return (
            f"CircuitBreaker({set_limits}; tripped={self._tripped.rule if self._tripped else None})"
        )

    # ------------------------------------------------------------------ the rules

    def admit(self, reservation: Reservation | None = None) -> Trip | None:
        """Before a model call: the standing trip, or a new one when the call cannot fit.

        With a `reservation` (the call's worst case), the call must fit beside every call
        already admitted and not yet settled; when it does, the breaker holds the reservation
        until `observe(..., reservation=)` or `release()` settles it."""
        with self._lock:
            if self._tripped is not None:
                return self._tripped
            want = reservation if reservation is not None else Reservation()
            cost = self._cost_nano + self._held_nano + want.cost_nano
            tokens = self._tokens + self._held_tokens + want.tokens
            turns = self._turns + self._held_turns + 1
            trip: Trip | None = None
            if self._cost_limit is not None and (
                self._cost_nano >= self._cost_limit or cost > self._cost_limit
            ):
                trip = self._admit_cost_trip(cost)
            elif self.max_tokens is not None and (
                self._tokens >= self.max_tokens or tokens > self.max_tokens
            ):
                trip = self._admit_tokens_trip(tokens, want.tokens)
            elif self.max_turns is not None and turns > self.max_turns:
                trip = self._turns_trip(turns)
            if trip is not None:
                self._tripped = trip
            elif reservation is not None and not reservation.held:
                reservation.held = True
                self._held_turns += 1
                self._held_tokens += reservation.tokens
                self._held_nano += reservation.cost_nano
            return trip

    def release(self, reservation: Reservation | None) -> None:
        """Gives back what `admit()` held for a call that ended without being observed (a
        replayed or refused call, an agent gone mid-call). Idempotent."""
        if reservation is None:
            return
        with self._lock:
            self._release_locked(reservation)

    def _release_locked(self, reservation: Reservation) -> None:
        if reservation.held:
            reservation.held = False
            self._held_turns -= 1
            self._held_tokens -= reservation.tokens
            self._held_nano -= reservation.cost_nano

    def _admit_cost_trip(self, cost_nano: int) -> Trip:
        spent = self._cost_nano / NANO
        worst = cost_nano / NANO
        # called only when max_cost_usd is set (then _cost_limit is too)
        if self._cost_nano >= self._cost_limit:  # type: ignore[operator]
            why = f"the run has spent {_fmt_usd(spent)}, all of max_cost_usd"
            worst = spent
        else:
            why = (
                f"this call could bring the run to {_fmt_usd(worst)} (spent {_fmt_usd(spent)}, "
                "plus the worst case of every call in flight and of this one), over max_cost_usd"
            )
        return Trip(
            "max_cost_usd",
            # called only when max_cost_usd is set
            self.max_cost_usd,  # type: ignore[arg-type]
            worst,
            # called only when max_cost_usd is set
            f"{why} {_fmt_usd(self.max_cost_usd)}, so the call is refused; "  # type: ignore[arg-type]
            "raise --max-cost-usd if the task is worth more",
        )

    def _admit_tokens_trip(self, tokens: int, this_call: int) -> Trip:
        # called only when max_tokens is set
        if self._tokens >= self.max_tokens:  # type: ignore[operator]
            why = f"the run has used {self._tokens} tokens, all of max_tokens"
            tokens = self._tokens
        else:
            why = (
                f"this call could bring the run to {tokens} tokens ({self._tokens} used, "
                f"{this_call} reserved for it from its max_tokens and prompt, the rest in "
                "flight), over max_tokens"
            )
        return Trip(
            "max_tokens",
            # called only when max_tokens is set
            self.max_tokens,  # type: ignore[arg-type]
            tokens,
            f"{why} {self.max_tokens}, so the call is refused; lower the call's max_tokens or "
            "raise --max-tokens if the task needs more",
        )

    def observe(
        self,
        *,
        cost_usd: float = 0.0,
        tokens: int = 0,
        text: str | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
        failed: str | bool | None = None,
        reservation: Reservation | None = None,
        retry: bool = False,
    ) -> Trip | None:
        """After one turn: adds it up and returns the trip standing afterwards, if any.

        `reservation`: what `admit()` held for this call, released now. `retry`: the call
        repeats a request whose answer was a retryable error (an SDK retrying); see the
        module docstring for how it counts."""
        if not (_is_int(cost_usd) or isinstance(cost_usd, float)) or not cost_usd >= 0:
            raise ValueError(f"cost_usd must be a number >= 0 (US dollars), not {cost_usd!r}")
        if not _is_int(tokens) or tokens < 0:
            raise ValueError(f"tokens must be a whole number >= 0, not {tokens!r}")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"text must be a string or None, not {type(text).__name__}")
        if tool_calls is not None and (
            not isinstance(tool_calls, list | tuple)
            or not all(isinstance(c, Mapping) for c in tool_calls)
        ):
            raise ValueError("tool_calls must be a list of dicts (one per call) or None")
        if isinstance(failed, bool):
            # A caller that knows only *that* a call failed: every such failure looks alike.
            failed = "failed" if failed else None
        if failed is not None and not isinstance(failed, str):
            raise ValueError(f"failed must be an error string or None, not {type(failed).__name__}")
        if not math.isfinite(cost_usd):
            raise ValueError(f"cost_usd must be a finite number of US dollars, not {cost_usd!r}")

        # The expensive part — vectorizing — happens outside the lock, and only when it matters.
        key: Any = None
        vector: Vector | None = None
        calls_sig = _calls_signature(tool_calls) if tool_calls else None
        if self.max_semantic_repeat is not None and (text or tool_calls):
            key = (text or "", calls_sig)
            if key != self._last_key:
                vector = output_vector(text, tool_calls) or None

        with self._lock:
            if reservation is not None:
                self._release_locked(reservation)
            self._cost_nano += round(cost_usd * NANO)
            self._tokens += tokens
            # A failed retry is the same logical call failing again: no new turn, no new step
            # of the repeat rules (the first attempt already counted once).
            counted = not (retry and failed is not None)
            if counted:
                self._turns += 1
                if key is not None:
                    self._step_repeat(key, vector, (text, tool_calls) if vector is None else None)
                if calls_sig is not None:
                    self._last_calls = calls_sig
                if self.max_repeat_failures is not None:
                    self._step_failures(failed)
            if self._tripped is None:
                self._tripped = self._first_broken_rule(failed)
            return self._tripped

    def check(
        self,
        *,
        cost_usd: float = 0.0,
        tokens: int = 0,
        text: str | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
        failed: str | bool | None = None,
    ) -> None:
        """`observe()`, raising BreakerTripped when the breaker is (or now becomes) tripped."""
        trip = self.observe(
            cost_usd=cost_usd, tokens=tokens, text=text, tool_calls=tool_calls, failed=failed
        )
        if trip is not None:
            raise BreakerTripped(trip)

    def _step_repeat(self, key: Any, vector: Vector | None, output: tuple[Any, Any] | None) -> None:
        if key == self._last_key:
            # The very same output again: similarity 1, and no need to vectorize it.
            self._repeat_run += 1
            return
        if vector is None and output is not None:
            # Another thread's observe() moved the last output after this one looked.
            vector = output_vector(*output) or None
        if (
            vector is not None
            and self._last_vector is not None
            and cosine(vector, self._last_vector) >= self.similarity_threshold
        ):
            self._repeat_run += 1
        else:
            self._repeat_run = 1
        self._last_key = key
        self._last_vector = vector

    def _step_failures(self, failed: str | None) -> None:
        if failed is None:
            self._fail_key = None
            self._fail_run = 0
            return
        key = (self._last_calls, _normalize_error(failed))
        if key == self._fail_key:
            self._fail_run += 1
        else:
            self._fail_key = key
            self._fail_run = 1

    def _first_broken_rule(self, failed: str | None) -> Trip | None:
        if self._cost_limit is not None and self._cost_nano > self._cost_limit:
            spent = self._cost_nano / NANO
            return Trip(
                "max_cost_usd",
                # this branch runs only when max_cost_usd is set
                self.max_cost_usd,  # type: ignore[arg-type]
                spent,
                f"the run has spent {_fmt_usd(spent)}, over max_cost_usd "
                # this branch runs only when max_cost_usd is set
                f"{_fmt_usd(self.max_cost_usd)} after {self._turns} turn(s); "  # type: ignore[arg-type]
                "raise --max-cost-usd if the task is worth more",
            )
        if self.max_tokens is not None and self._tokens > self.max_tokens:
            return Trip(
                "max_tokens",
                self.max_tokens,
                self._tokens,
                f"the run has used {self._tokens} tokens, over max_tokens {self.max_tokens} "
                f"after {self._turns} turn(s); raise --max-tokens if the task needs more",
            )
        if self.max_turns is not None and self._turns > self.max_turns:
            return self._turns_trip(self._turns)
        if self.max_semantic_repeat is not None and self._repeat_run >= self.max_semantic_repeat:
            return Trip(
                "max_semantic_repeat",
                self.max_semantic_repeat,
                self._repeat_run,
                f"the agent produced {self._repeat_run} near-duplicate outputs in a row "
                f"(similarity >= {self.similarity_threshold:g}), reaching max_semantic_repeat "
                f"{self.max_semantic_repeat}: it is looping; change its prompt or tools, or "
                "raise --max-repeat",
            )
        if self.max_repeat_failures is not None and self._fail_run >= self.max_repeat_failures:
            error = _normalize_error(failed or "")
            excerpt = error if len(error) <= 120 else error[:117] + "..."
            call = (self._last_calls or "").split("\n", 1)[0]
            what = f"the call {call[:80]!r}" if call else "the same step"
            return Trip(
                "max_repeat_failures",
                self.max_repeat_failures,
                self._fail_run,
                f"{what} failed {self._fail_run} times in a row with the same error "
                f"({excerpt!r}), reaching max_repeat_failures {self.max_repeat_failures}; fix "
                "what makes it fail, or raise --max-repeat",
            )
        return None

    def _turns_trip(self, turn: int) -> Trip:
        return Trip(
            "max_turns",
            # called only when max_turns is set
            self.max_turns,  # type: ignore[arg-type]
            turn,
            f"turn {turn} would exceed max_turns {self.max_turns}; raise --max-turns if the "
            "task needs more turns",
        )

    # ------------------------------------------------------------------ snapshots

    def state(self) -> BreakerState:
        """An O(1) snapshot for `restore()`."""
        with self._lock:
            return BreakerState(
                self._cost_nano,
                self._tokens,
                self._turns,
                self._repeat_run,
                self._last_key,
                self._last_vector,
                self._fail_key,
                self._fail_run,
                self._last_calls,
                self._tripped,
            )

    def restore(self, state: BreakerState, *, spend: bool = False) -> None:
        """Rewinds to a snapshot: the conversation's runs, and with `spend=True` also cost,
        tokens, turns and the trip (see the module docstring for why not by default)."""
        if not isinstance(state, BreakerState):
            raise ValueError(
                f"restore() takes a state from CircuitBreaker.state(), not {type(state).__name__}"
            )
        with self._lock:
            self._repeat_run = state.repeat_run
            self._last_key = state.last_key
            self._last_vector = state.last_vector
            self._fail_key = state.fail_key
            self._fail_run = state.fail_run
            self._last_calls = state.last_calls
            if spend:
                self._cost_nano = state.cost_nano
                self._tokens = state.tokens
                self._turns = state.turns
                self._tripped = state.tripped

    def reset(self) -> None:
        """Forgets everything: totals, runs and the trip."""
        with self._lock:
            self._cost_nano = 0
            self._tokens = 0
            self._turns = 0
            self._repeat_run = 0
            self._last_key = None
            self._last_vector = None
            self._fail_key = None
            self._fail_run = 0
            self._last_calls = None
            self._tripped = None
            # What admit() holds for calls in flight (not part of state(): a call in flight
            # settles whatever a rollback does).
            self._held_turns = 0
            self._held_tokens = 0
            self._held_nano = 0
