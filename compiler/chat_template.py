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
apply_chat_template(continue_final_message=True) does. render(..., template_kwargs={...}) passes extra variables to
the template (vLLM's chat_template_kwargs, e.g. Qwen3's enable_thinking).

A model without a template of its own gets kiln's default, and a warning once per process (vLLM refuses to chat
then). A template given by the caller (LLM.chat's chat_template, --chat-template) is a file or the template's text,
read as vLLM reads --chat-template (chat_template_arg).
"""

from __future__ import annotations

import functools
import json
import logging
import os
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


class ChatArgumentError(RequestError, ValueError):
    """render's arguments that cannot go together: the caller's mistake, so a RequestError naming the parameter;
    also a ValueError, which transformers' apply_chat_template raises for the same call, so code written against it
    still catches it."""


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
               continue_final_message: bool = False, template_kwargs: dict | None = None) -> str:
        """The prompt text of a conversation; a template's raise_exception or a render failure is a
        ChatTemplateError naming the template's origin. continue_final_message (add_generation_prompt False): the
        prompt ends right after the final message's text (a string), cut as transformers cuts it: at a marker
        rendered after the text; a template that trims the text (Llama 3's) trims the marker's space, and then the
        whitespace before the marker goes too; with add_generation_prompt it is a ChatArgumentError. template_kwargs:
        more variables for the template (vLLM's chat_template_kwargs; bos_token / eos_token among them override the
        tokenizer's, as in transformers)."""
        extra = check_template_kwargs(template_kwargs)
        if not continue_final_message:
            return self._render(messages, add_generation_prompt, extra)
        if add_generation_prompt:
            raise ChatArgumentError("continue_final_message and add_generation_prompt cannot both be true",
                                    param="continue_final_message")
        final = messages[-1].get("content") if messages else None
        if not isinstance(final, str):
            raise ChatTemplateError("continue_final_message needs a final message whose content is text")
        text = self._render([*messages[:-1], {**messages[-1], "content": final + _CONTINUE}], False, extra)
        tag = _CONTINUE.strip()
        if final.strip() not in text or tag not in text:
            raise ChatTemplateError(f"the chat template ({self.origin}) does not render the final message's text "
                                    "as it was sent, so the prompt cannot continue it (continue_final_message)")
        at = text.rindex(tag)
        return text[:at] if text.startswith(_CONTINUE, at) else text[:at].rstrip()

    def _render(self, messages: list[dict], add_generation_prompt: bool, extra: dict | None = None) -> str:
        try:
            return self._template.render(**{"bos_token": self.bos_token, "eos_token": self.eos_token, **(extra or {}),
                                            "messages": messages, "add_generation_prompt": add_generation_prompt})
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


def _tokenizer_config(d: Path) -> dict:
    path = d / "tokenizer_config.json"
    cfg = {}
    if path.is_file():
        try:
            cfg = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise KilnError(f"{path}: not valid JSON ({e}); fix or remove the file") from None
    return cfg if isinstance(cfg, dict) else {}


def special_token_texts(checkpoint_dir: str | Path) -> tuple[str, str]:
    """(BOS text, EOS text) from a checkpoint's tokenizer_config.json ("" for one it does not name)."""
    cfg = _tokenizer_config(Path(checkpoint_dir))
    return _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))


def load_chat_template(checkpoint_dir: str | Path) -> ChatTemplate | None:
    """A Hugging Face checkpoint's chat template, or None when it has none: chat_template.jinja (where
    transformers 4.43+ saves it; it wins, as in transformers), else tokenizer_config.json's chat_template (of a
    named list, the "default" one). BOS / EOS text from tokenizer_config.json either way."""
    d = Path(checkpoint_dir)
    path = d / "tokenizer_config.json"
    cfg = _tokenizer_config(d)
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


log = logging.getLogger("kiln.chat_template")
_default_noted = False  # the default template's warning is given once per process


def chat_template_of(tokenizer: object, chat_template: str | os.PathLike | ChatTemplate | None = None) -> ChatTemplate:
    """The template a conversation is rendered with: `chat_template` when given (a ChatTemplate, or a file or the
    template's text, see chat_template_arg; with the tokenizer's BOS / EOS text), else the tokenizer's own (a
    checkpoint's, a GGUF's), else kiln's default, with a warning the first time (vLLM refuses to chat then)."""
    global _default_noted
    if chat_template is not None:
        if isinstance(chat_template, ChatTemplate):
            return chat_template
        return chat_template_arg(chat_template, bos_token=_text_attr(tokenizer, "bos_token"),
                                 eos_token=_text_attr(tokenizer, "eos_token"))
    own = getattr(tokenizer, "chat_template", None)
    if own is not None:
        return own
    if not _default_noted:
        _default_noted = True
        log.warning("this model has no chat template (no chat_template.jinja, tokenizer_config.json chat_template or "
                    "GGUF tokenizer.chat_template), so chat prompts use kiln's default `<|role|>` lines, which the "
                    "model was not trained on; give its template with chat_template= (LLM.chat) or --chat-template")
    return default_chat_template()


def _text_attr(tokenizer: object, name: str) -> str:
    value = getattr(tokenizer, name, None)
    return value if isinstance(value, str) else ""


_JINJA_CHARS = "{}\n"  # vLLM's test: a value with none of these that is not a readable file was meant as a path


def chat_template_arg(value: str | os.PathLike, *, bos_token: str = "", eos_token: str = "") -> ChatTemplate:
    """A chat template given by the caller, read as vLLM reads --chat-template: a file's contents when `value`
    names one that opens, else `value` itself as the template's text; a value that cannot be opened and has no
    Jinja characters ({, }, a newline) was meant as a path, and is a ChatTemplateError saying why it did not open."""
    text, origin = str(value), "the template text given"
    try:
        with open(value, encoding="utf-8") as f:
            text, origin = f.read(), str(value)
    except UnicodeDecodeError as e:
        raise ChatTemplateError(f"chat template file {value}: not UTF-8 text ({e})") from None
    except (OSError, ValueError) as e:  # ValueError: a NUL in the text
        if isinstance(value, os.PathLike) or not any(c in text for c in _JINJA_CHARS):
            why = e.strerror if isinstance(e, OSError) and e.strerror else e
            raise ChatTemplateError(f"chat template {str(value)!r} looks like a file path, but it cannot be opened "
                                    f"({why}); give a readable file or the template's own text") from None
    return _cached_template(text, bos_token, eos_token, origin)


@functools.lru_cache(maxsize=16)  # the same template given again (every LLM.chat call) is parsed once
def _cached_template(text: str, bos_token: str, eos_token: str, origin: str) -> ChatTemplate:
    return ChatTemplate(text, bos_token=bos_token, eos_token=eos_token, origin=origin)


# Variables the renderer sets from the call's own arguments: chat_template_kwargs cannot replace them.
_RESERVED = ("messages", "add_generation_prompt")


def check_template_kwargs(kwargs: object) -> dict | None:
    """chat_template_kwargs as the template gets them: None or a dict of str keys; RequestError otherwise, or for a
    key the renderer sets itself (messages, add_generation_prompt: the call's own arguments say those)."""
    if kwargs is None:
        return None
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise RequestError("chat_template_kwargs must be a dict of template variables by name (e.g. "
                           '{"enable_thinking": False}), not ' + type(kwargs).__name__, param="chat_template_kwargs")
    taken = [k for k in _RESERVED if k in kwargs]
    if taken:
        raise RequestError(f"chat_template_kwargs cannot set {', '.join(taken)}: pass the conversation as messages "
                           "and add_generation_prompt as its own argument", param="chat_template_kwargs")
    return kwargs


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
