"""Tokens to the text a client sees: incremental detokenization with stop strings, and chat templates.

Both live outside the engine, which only knows token ids: a stop string can span several tokens (and a
token can end inside a multi-byte character), so it is found in the decoded text, not in the ids.
"""

from __future__ import annotations

import json
from pathlib import Path

# The template of the random-weight presets (byte tokenizer): one header line per role, the content on
# the lines after it, and an open assistant header that the model continues.
SIMPLE_CHAT_TEMPLATE = "<|{role}|>\n{content}\n"
SIMPLE_GENERATION_PROMPT = "<|assistant|>\n"


class TextStream:
    """The text of a growing list of token ids, released in deltas that never need taking back.

    Each `feed` decodes every token so far (prompts and outputs are short next to a forward pass, so
    this costs nothing that matters) and releases the text up to the end, holding back what could still
    change: a trailing replacement character (a multi-byte character cut between tokens) and a tail that
    is a prefix of a stop string. When a stop string appears, the text ends just before it and `stopped`
    is set; the caller then cancels the request.
    """

    def __init__(self, tokenizer, stop: list[str]):
        self.tok, self.stop = tokenizer, [s for s in stop if s]
        self.sent = 0  # characters released so far
        self.stopped = False
        self.n_tokens = 0  # tokens that made up the released text (all of them, or those up to the stop)

    def feed(self, tokens: list[int], final: bool = False) -> str:
        """The new text after `tokens` (all tokens so far); `final`: the request ended, release everything."""
        if self.stopped:
            return ""
        text = self.tok.decode(tokens)
        self.n_tokens = len(tokens)
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            end, self.stopped = min(hits), True
        elif final:
            end = len(text)
        else:
            end = len(text.rstrip("\ufffd"))
            for s in self.stop:  # hold back a tail that may still become a stop string
                for k in range(min(len(s) - 1, end), 0, -1):
                    if text[:end].endswith(s[:k]):
                        end -= k
                        break
        delta, self.sent = text[self.sent:max(end, self.sent)], max(end, self.sent)
        return delta


def load_chat_template(checkpoint: str | None) -> str | None:
    """The `chat_template` of the checkpoint's tokenizer_config.json (a Jinja template), or None when there
    is no checkpoint, no such file or no template in it (the simple template is used then)."""
    if not checkpoint:
        return None
    path = Path(checkpoint) / "tokenizer_config.json"
    if not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read it ({e}); fix or remove the file") from None
    template = cfg.get("chat_template")
    if isinstance(template, list):  # the named-template form: [{"name": "default", "template": ...}, ...]
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


def render_chat(messages: list[dict], template: str | None, bos_token: str = "") -> str:
    """The prompt text of a conversation: through the checkpoint's Jinja `template` when there is one, else
    SIMPLE_CHAT_TEMPLATE per message followed by SIMPLE_GENERATION_PROMPT."""
    if template is None:
        return "".join(SIMPLE_CHAT_TEMPLATE.format(**m) for m in messages) + SIMPLE_GENERATION_PROMPT
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # a template from a download is untrusted code

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(msg):
        raise ValueError(f"the chat template refused the conversation: {msg}")

    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, bos_token=bos_token,
                                            eos_token="")
