"""What the OpenAI-compatible API accepts and how it fails: request bodies (pydantic), OpenAI's error shape, the
server's limits and defaults."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from edgekv.serve.engine import Engine
from edgekv.serve.sampling import SamplingParams

MAX_LOGPROBS = 5


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_body(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code if code else str(status)}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Generation(BaseModel):
    """What completions and chat requests share (fields OpenAI's API has and edgekv does not use are accepted
    and ignored)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=10)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None


class CompletionRequest(_Generation):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant"]
    content: str


class ChatRequest(_Generation):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


@dataclass
class ServedModel:
    """The model a request picked: its id and the engine over its system-prompt export."""

    id: str
    engine: Engine


@dataclass
class APISettings:
    """What the server enforces."""

    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    max_tokens_limit: int = 512
    defaults: SamplingParams = field(default_factory=SamplingParams)  # what a request leaves out
