"""Chat templates: the checkpoint's own (tokenizer_config.json's chat_template, rendered with Jinja2 in a
sandbox, as transformers does), else kiln's documented default:

    <|system|>
    You are helpful.
    <|user|>
    Hi!
    <|assistant|>

one `<|role|>` line before each message's text, ending with `<|assistant|>` and a newline for the reply.
"""

from __future__ import annotations

import json
from pathlib import Path

from kiln.errors import KilnError

DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class ChatTemplate:
    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", origin: str = "default"):
        from jinja2 import StrictUndefined, TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=StrictUndefined)
        env.globals["raise_exception"] = _raise
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise KilnError(f"chat template from {origin} does not parse ({e}); fix it or remove chat_template") \
                from None
        self.bos_token, self.eos_token, self.origin = bos_token, eos_token, origin

    def render(self, messages: list[dict[str, str]]) -> str:
        return self._template.render(messages=messages, add_generation_prompt=True, bos_token=self.bos_token,
                                     eos_token=self.eos_token)


def _raise(message: str) -> None:
    raise ValueError(message)


def _token_text(value) -> str:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older tokenizer_config.json files
        return str(value.get("content", ""))
    return value or ""


def load_chat_template(weights_dir: str | Path | None) -> ChatTemplate:
    """The checkpoint's chat template when its tokenizer_config.json has one, else the default."""
    path = Path(weights_dir) / "tokenizer_config.json" if weights_dir is not None else None
    if path is None or not path.is_file():
        return ChatTemplate(DEFAULT_CHAT_TEMPLATE)
    cfg = json.loads(path.read_text())
    tpl = cfg.get("chat_template")
    if isinstance(tpl, list):  # named templates: take "default"
        tpl = next((t.get("template") for t in tpl if t.get("name") == "default"), None)
    if not tpl:
        return ChatTemplate(DEFAULT_CHAT_TEMPLATE)
    return ChatTemplate(tpl, bos_token=_token_text(cfg.get("bos_token")), eos_token=_token_text(cfg.get("eos_token")),
                        origin=str(path))
