"""What a model call may cost at most, known before it is forwarded.

The breaker admits each call against its limits with this worst case held in reserve, so that
calls in flight together cannot each pass the check against the same total (eight parallel
calls under `--max-turns 3`). The real usage replaces the reservation when the call settles.

* Output tokens: the request's own cap — `max_tokens` (Anthropic, OpenAI chat),
  `max_completion_tokens` (OpenAI chat), `max_output_tokens` (OpenAI responses),
  `generationConfig.maxOutputTokens` (Gemini) — times `n` choices (`candidateCount`). A
  request without a cap reserves no output: its output is unbounded, and is counted when the
  response arrives.
* Input tokens: the request body's bytes / 4 (about four bytes a token in English and JSON),
  rounded up. The body carries JSON syntax and tool schemas too, so this leans high.
* Cost: those tokens at the model's price (`jukebox.llm.pricing`); a model without a price
  reserves no cost.
"""

from __future__ import annotations

import math
from typing import Any

from jukebox.guard.breaker import Reservation
from jukebox.llm.pricing import PriceTable

BYTES_PER_TOKEN = 4
_OUTPUT_CAPS = ("max_completion_tokens", "max_tokens", "max_output_tokens")


def _whole(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def output_cap(request: Any) -> int:
    """The most output tokens a request allows (0: it sets no cap)."""
    if not isinstance(request, dict):
        return 0
    cap = next((_whole(request.get(k)) for k in _OUTPUT_CAPS if _whole(request.get(k))), 0)
    config = request.get("generationConfig")  # Gemini's native API
    if not cap and isinstance(config, dict):
        cap = _whole(config.get("maxOutputTokens")) * max(_whole(config.get("candidateCount")), 1)
    return cap * max(_whole(request.get("n")), 1)


def worst_case(
    request: Any,
    body_size: int,
    prices: PriceTable,
    provider: str | None = None,
    upstream: str | None = None,
) -> Reservation:
    """The reservation for one call: `request` its parsed JSON body, `body_size` its bytes."""
    inputs = math.ceil(body_size / BYTES_PER_TOKEN)
    outputs = output_cap(request)
    model = request.get("model") if isinstance(request, dict) else None
    usage = {"input": inputs, "output": outputs}
    cost = prices.cost(model if isinstance(model, str) else None, usage, provider, upstream)
    return Reservation.of(inputs + outputs, cost or 0.0)
