"""Which server-sent event ends a model's stream, in each wire protocol.

The proxy forwards a stream event by event as the events complete, but holds back the event
that ends it (and anything after it) until the call's `llm_turn` frame is written: an agent that
acts on the end of an answer then acts after the frame, so the tape's order of frames is the
order the agent observed. A stream with no such event (a protocol that just closes) has its
last event forwarded before the frame, and only the close of the response after it.
"""

from __future__ import annotations

from jukebox.llm.sse import SSEEvent

# OpenAI Responses and Anthropic Messages name their last event (also in its data's `type`).
FINAL_TYPES = frozenset(
    {
        "message_stop",  # Anthropic Messages
        "response.completed",  # OpenAI Responses, and its two other endings
        "response.failed",
        "response.incomplete",
        "error",  # both: a stream that fails ends with its error
    }
)
# is_final spells each of them out again: keep both in step.

def is_final(event: SSEEvent) -> bool:
    """Whether `event` ends its stream: OpenAI Chat's `[DONE]`, or a final event type."""
    if event.data.strip() == "[DONE]" or event.event in FINAL_TYPES:
        return True
    # Parsed only when a final type is named in it: this runs on every event of every stream
    # (substring tests in a row, not a generator over the set: twice as fast, as is a regex).
    data = event.data
    if not (
        "message_stop" in data or "response.completed" in data or "response.failed" in data
        or "response.incomplete" in data or "error" in data
    ):  # fmt: skip
        return False
    value = event.json()
    return isinstance(value, dict) and value.get("type") in FINAL_TYPES
