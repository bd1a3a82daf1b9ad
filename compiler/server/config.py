"""The server's settings (ServerConfig): the served model ids, the API key, limits, CORS, chat template and
sampling defaults that `kiln serve`'s flags set."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kiln.chat_template import ChatTemplate
from kiln.errors import UsageError

MAX_BODY_BYTES = 32 << 20  # --max-body-bytes' default: a 131072-token context as token ids (~1 MiB) many times over


@dataclass
class ServerConfig:
    """model_name: the model id the server reports (in responses, /health and /metrics), or a list of ids (vLLM's
    --served-model-name): the first is reported, every one is listed in /v1/models and accepted as a request's model;
    model_aliases: more ids accepted as a request's model, not listed."""

    model_name: str | Sequence[str]
    api_key: str | None = None
    max_body_bytes: int | None = MAX_BODY_BYTES  # None or 0: no limit
    max_prompt_tokens: int | None = None  # None: the engine's max_model_len
    max_waiting: int | None = None  # requests queued (not yet running) before new ones get 503 (None: no limit)
    chat_template: ChatTemplate | None = None
    model_aliases: Sequence[str] = ()
    # CORS, as vLLM's --allowed-origins / --allowed-methods / --allowed-headers / --allow-credentials
    allowed_origins: Sequence[str] = field(default_factory=lambda: ["*"])
    allowed_methods: Sequence[str] = field(default_factory=lambda: ["*"])
    allowed_headers: Sequence[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    # The model's recommended sampling (LoadedModel.generation_defaults, vLLM's --generation-config auto), keyed by
    # SamplingParams field: applied to the request fields a client leaves unset (or sends as null); its max_tokens
    # to chat without max_tokens and to completions' max_tokens null (omitted, it is 16, as in vLLM)
    generation_defaults: Mapping[str, object] = field(default_factory=dict)
    # vLLM's --trust-request-chat-template: whether a request may bring its own chat template (chat_template)
    trust_request_chat_template: bool = False

    @property
    def model_names(self) -> list[str]:
        """The served model ids, the reported one first."""
        names = [self.model_name] if isinstance(self.model_name, str) else list(self.model_name)
        if not names or not all(isinstance(n, str) and n for n in names):
            raise UsageError(f"model_name: give one or more non-empty model ids, not {self.model_name!r}")
        return names
