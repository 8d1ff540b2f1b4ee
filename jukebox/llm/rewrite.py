"""Request overrides for forks: another model (per provider: see `model_override`) or another
system prompt on every request.

Applied by the proxy to each live request before it is forwarded (and before it is recorded, so
the tape shows what was really sent). The agent's own request is what replay matching sees.
Gemini's native API names the model in the path, not the body: `path` rewrites it there.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from jukebox.llm import gemini
from jukebox.llm.model_override import model_for
from jukebox.llm.providers import ANTHROPIC, CHAT, GEMINI, MESSAGES, RESPONSES


@dataclass(frozen=True)
class RequestRewriter:
    # {provider: model}: those providers' calls only; a string: every provider's.
    model: str | Mapping[str, str] | None = None
    system_prompt: str | None = None

    @property
    def active(self) -> bool:
        return self.model is not None or self.system_prompt is not None

    def path(self, provider: str, path: str, rest: str) -> str | None:
        """The path and query to forward in place of `rest` when the model override changes
        the path (Gemini), else None. `path` is the decoded path the proxy routed on."""
        model = model_for(self.model, provider)
        if provider != GEMINI or model is None:
            return None
        changed = gemini.with_model(path, model)
        if changed is None or changed == path:
            return None
        _, mark, query = rest.partition("?")
        return quote(changed, safe="/:") + mark + query

    def apply(self, provider: str, endpoint: str, body: Any) -> Any:
        """A rewritten copy of `body` (the original is left alone); non-dicts pass unchanged."""
        if not self.active or not isinstance(body, dict):
            return body
        out = copy.deepcopy(body)
        model = model_for(self.model, provider)
        if model is not None and provider != GEMINI:  # Gemini's model is in the path
            out["model"] = model
        if self.system_prompt is None:
            return out
        if provider == ANTHROPIC and endpoint == MESSAGES:
            out["system"] = self.system_prompt
        elif endpoint == CHAT:
            out["messages"] = _replace_system(out.get("messages"), self.system_prompt, "system")
        elif endpoint == RESPONSES:
            out["instructions"] = self.system_prompt
            if isinstance(out.get("input"), list):
                out["input"] = [
                    item
                    for item in out["input"]
                    if not (isinstance(item, dict) and item.get("role") in ("system", "developer"))
                ]
        return out


def _replace_system(messages: Any, prompt: str, role: str) -> Any:
    """The first system or developer message gets `prompt`; without one, it is put first."""
    if not isinstance(messages, list):
        return messages
    out = list(messages)
    for i, message in enumerate(out):
        if isinstance(message, dict) and message.get("role") in ("system", "developer"):
            out[i] = {**message, "content": prompt}
            return out
    return [{"role": role, "content": prompt}, *out]
