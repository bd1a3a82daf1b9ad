"""Chat templates: one Jinja2 renderer for every tokenizer kiln loads (a checkpoint's tokenizer_config.json, a
GGUF's tokenizer.chat_template), set up as transformers sets up its own (a sandbox, trim_blocks, lstrip_blocks,
loop controls, `raise_exception`, `strftime_now`, a `tojson` that does not escape HTML), and kiln's documented
default for a model without one:

    <|system|>
    You are helpful.
    <|user|>
    Hi!
    <|assistant|>

one `<|role|>` line before each message's text, ending with `<|assistant|>` and a newline for the reply.

render(..., continue_final_message=True) ends the prompt inside the final message instead, right after its text (its
closing tokens and the generation prompt dropped), so that the model continues it, as transformers'
apply_chat_template(continue_final_message=True) does.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kiln.errors import KilnError, RequestError

DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class ChatTemplateError(KilnError):
    """A chat template that does not parse, or that refused (raise_exception) or failed on a conversation."""


class ChatTemplate:
    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", origin: str = "default"):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise ChatTemplateError(f"chat template from {origin} does not parse ({e}); fix it or remove "
                                    "chat_template") from None
        self.source = source
        self.bos_token, self.eos_token, self.origin = bos_token, eos_token, origin

    def render(self, messages: list[dict], add_generation_prompt: bool = True, *,
               continue_final_message: bool = False) -> str:
        """The prompt text of a conversation; a template's raise_exception or a render failure is a
        ChatTemplateError naming the template's origin. continue_final_message (add_generation_prompt False): the
        prompt ends right after the final message's text (a string), cut as transformers cuts it: at a marker
        rendered after the text; a template that trims the text (Llama 3's) trims the marker's space, and then the
        whitespace before the marker goes too."""
        if not continue_final_message:
            return self._render(messages, add_generation_prompt)
        if add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        final = messages[-1].get("content") if messages else None
        if not isinstance(final, str):
            raise ChatTemplateError("continue_final_message needs a final message whose content is text")
        text = self._render([*messages[:-1], {**messages[-1], "content": final + _CONTINUE}], False)
        tag = _CONTINUE.strip()
        if final.strip() not in text or tag not in text:
            raise ChatTemplateError(f"the chat template ({self.origin}) does not render the final message's text "
                                    "as it was sent, so the prompt cannot continue it (continue_final_message)")
        at = text.rindex(tag)
        return text[:at] if text.startswith(_CONTINUE, at) else text[:at].rstrip()

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except _Refused as e:
            raise ChatTemplateError(f"the chat template ({self.origin}) refused the conversation: {e}") from None
        except (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise ChatTemplateError(f"the chat template ({self.origin}) cannot render the conversation "
                                    f"({type(e).__name__}: {e})") from None


# transformers' own marker: a prompt cut at it is apply_chat_template(continue_final_message=True)'s, byte for byte
_CONTINUE = "CONTINUE_FINAL_MESSAGE_TAG "


class _Refused(Exception):
    pass


def _raise(message: str) -> None:
    raise _Refused(message)


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def default_chat_template() -> ChatTemplate:
    return ChatTemplate(DEFAULT_CHAT_TEMPLATE)


def _token_text(value: object) -> str:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older tokenizer_config.json files
        return str(value.get("content", ""))
    return str(value) if value else ""


def load_chat_template(checkpoint_dir: str | Path) -> ChatTemplate | None:
    """A Hugging Face checkpoint's chat template, or None when it has none: chat_template.jinja (where
    transformers 4.43+ saves it; it wins, as in transformers), else tokenizer_config.json's chat_template (of a
    named list, the "default" one). BOS / EOS text from tokenizer_config.json either way."""
    d = Path(checkpoint_dir)
    path = d / "tokenizer_config.json"
    cfg = {}
    if path.is_file():
        try:
            cfg = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise KilnError(f"{path}: not valid JSON ({e}); fix or remove the file") from None
        cfg = cfg if isinstance(cfg, dict) else {}
    tpl = cfg.get("chat_template")
    if isinstance(tpl, list):  # named templates: take "default"
        tpl = next((t.get("template") for t in tpl if isinstance(t, dict) and t.get("name") == "default"), None)
    origin = str(path)
    if (d / "chat_template.jinja").is_file():
        origin = str(d / "chat_template.jinja")
        tpl = (d / "chat_template.jinja").read_text()
    if not tpl or not isinstance(tpl, str):
        return None
    return ChatTemplate(tpl, bos_token=_token_text(cfg.get("bos_token")), eos_token=_token_text(cfg.get("eos_token")),
                        origin=origin)


def chat_template_of(tokenizer: object) -> ChatTemplate:
    """The tokenizer's own chat template (a checkpoint's, a GGUF's), else kiln's default."""
    return getattr(tokenizer, "chat_template", None) or default_chat_template()


def message_text(content: object) -> str:
    """A chat message's content as the text its template gets (`kiln serve` and LLM.chat alike): a string as it is,
    None as "", and OpenAI's list of content parts as their texts joined with newlines, as vLLM joins them. A part
    that is not text (an image, audio) is a RequestError naming its type: kiln's models read text only."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        raise RequestError(f"message content must be a string or a list of content parts, not "
                           f"{type(content).__name__}", param="messages")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text":
            raise RequestError(f"message content part of type {kind!r} is not supported; only text parts are "
                               '({"type": "text", "text": "..."})', param="messages")
        if not isinstance(part.get("text"), str):
            raise RequestError("a message content part of type 'text' needs a string \"text\" field",
                               param="messages")
        texts.append(part["text"])
    return "\n".join(texts)
