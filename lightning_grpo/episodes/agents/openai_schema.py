"""The agent gateway's request body: OpenAI's Chat Completions request (pydantic models), every field typed and
unknown fields refused, so a bad body is an HTTP 400 naming the field (``body.messages.1.role: Input should be
'system', 'developer', 'user', 'assistant' or 'tool'``) before any work is done.

Only what a token-exact training rollout can honour is accepted with a value that changes the answer: text content
(a list of ``{"type": "text"}`` parts is joined), function tools, ``tool_choice`` ``"auto"`` / ``"none"``, one
choice. Sampling fields (``temperature``, ``top_p``, ``max_tokens``) are checked against the trainer's sampling by
the session (:mod:`lightning_grpo.episodes.agents.session`): the trainer scores the distribution it samples, so an agent
may leave them unset or repeat the trainer's values, and may lower ``max_tokens``. Fields that do not change the
answer (``user``, ``metadata``, ``store``, ``parallel_tool_calls``, ``return_token_ids``) are accepted, and so are
the fields of OpenAI's assistant message that an agent echoing an answer back (``message.model_dump()``) sends empty
(``refusal``, ``audio``, ``function_call`` null, ``annotations`` null or ``[]``): a value in one of them is refused.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationInfo, field_validator


class GatewayError(Exception):
    """An error answered to the agent: ``status`` (400, 404, 408, ...), OpenAI's ``type`` and ``code``, the request
    field it concerns (``param``)."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Body):
    """One part of a message's content; only text (images and audio are refused)."""

    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    """A tool call's function: its name and its arguments as a JSON string (OpenAI's wire format)."""

    name: str = Field(min_length=1, max_length=256)
    arguments: str = ""


class ToolCallItem(_Body):
    """One of an assistant message's ``tool_calls``."""

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    """One message of the conversation the agent sends."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCallItem]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None
    # Fields of OpenAI's assistant message that an agent echoing an answer back (``message.model_dump()``) sends as
    # null or empty: accepted then and ignored (compared as absent by the extension rule); a value is refused, since
    # the gateway's answers never carry one and the chat template cannot render it.
    refusal: Optional[str] = None
    audio: Optional[dict[str, Any]] = None
    function_call: Optional[FunctionCall] = None
    annotations: Optional[list[Any]] = None

    @field_validator("refusal", "audio", "function_call")
    @classmethod
    def _null(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            hint = " (the deprecated form of tool_calls: send tool_calls)" if info.field_name == "function_call" else ""
            raise ValueError(f"must be null{hint}: the gateway's answers never carry {info.field_name} and the chat "
                             "template cannot render it")
        return value

    @field_validator("annotations")
    @classmethod
    def _empty(cls, value: Optional[list[Any]]) -> Optional[list[Any]]:
        if value:
            raise ValueError("must be null or empty: the gateway's answers never carry annotations and the chat "
                             "template cannot render them")
        return value

    def text(self) -> str:
        """The content as one string ("" for none; text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionSpec(_Body):
    """A function tool's description (rendered by the chat template, or the tool parser's instructions)."""

    name: str = Field(min_length=1, max_length=256)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ToolSpec(_Body):
    """One of the request's ``tools``: a function."""

    type: Literal["function"]
    function: FunctionSpec


class StreamOptions(_Body):
    include_usage: Optional[StrictBool] = None


class ChatCompletionRequest(_Body):
    """``POST /sessions/{session}/v1/chat/completions``."""

    model: str = Field(min_length=1, max_length=512)
    messages: list[ChatMessage] = Field(min_length=1)
    tools: Optional[list[ToolSpec]] = None
    tool_choice: Optional[Literal["auto", "none"]] = None
    parallel_tool_calls: Optional[StrictBool] = None
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    max_completion_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0)
    top_p: Optional[float] = Field(default=None, gt=0, le=1)
    n: Optional[StrictInt] = Field(default=None, ge=1, le=1)
    logprobs: Optional[StrictBool] = None
    top_logprobs: Optional[StrictInt] = Field(default=None, ge=0, le=0)
    frequency_penalty: Optional[float] = Field(default=None, ge=0, le=0)
    presence_penalty: Optional[float] = Field(default=None, ge=0, le=0)
    user: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    store: Optional[StrictBool] = None
    return_token_ids: Optional[StrictBool] = None

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, tools: Optional[list[ToolSpec]]) -> Optional[list[ToolSpec]]:
        if tools:
            names = [t.function.name for t in tools]
            if len(set(names)) != len(names):
                raise ValueError(f"tool names must be unique, got {names}")
        return tools

    def completion_limit(self) -> Optional[int]:
        """The agent's own cap on the completion's tokens (``max_completion_tokens``, else ``max_tokens``)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools as the chat template gets them (``{"type": "function", "function": {...}}``, unset fields
        left out)."""
        return [t.model_dump(exclude_none=True) for t in (self.tools or [])]
