"""The lines of an OpenAI Batch API input file: ``{"custom_id", "method": "POST", "url", "body"}``, one per line.

Two checks, as OpenAI makes them. When a file is uploaded with purpose ``batch``, every line must be such a
request (a bad line or a repeated ``custom_id`` refuses the upload). When a batch is created, every line must
also fit the batch: its ``url`` must be the batch's endpoint, and the body must be a request that endpoint
takes; otherwise the batch fails with one error per bad line.

Bodies are the endpoint's requests as they are, ``response_format`` (text, json_object, json_schema) and, on
chat completions, ``tools`` / ``tool_choice`` included: they reach the model with the line's other fields,
and a field the model refuses fails that line alone (its entry in the error file names the field).

A ``/v1/embeddings`` line's body is OpenAI's embeddings request: ``input`` (a string, a list of strings, a list of
token ids or a list of such lists; at most 2,048 inputs a line), ``encoding_format`` and ``dimensions``. As at
OpenAI, a batch of embeddings holds at most 50,000 inputs across all its lines.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from app import json_limits

CHAT_COMPLETIONS = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
ENDPOINTS = (CHAT_COMPLETIONS, COMPLETIONS, EMBEDDINGS)

MAX_EMBEDDING_INPUTS_PER_LINE = 2048  # OpenAI's limit of inputs in one embeddings request
MAX_EMBEDDING_INPUTS_PER_BATCH = 50_000  # OpenAI's limit of embedding inputs across a batch's lines

MAX_CUSTOM_ID = 255  # the items table's limit
MAX_REPORTED_ERRORS = 100  # a failed batch lists at most this many bad lines

#: body fields that are not sampling options: the model is the server's, and batch answers are never streamed
_NOT_OPTIONS = frozenset({"messages", "prompt", "model", "stream", "stream_options"})
#: chat fields a ``/v1/completions`` line may not carry (its prompt is sent as a chat, where they would apply)
_CHAT_ONLY = ("tools", "tool_choice", "parallel_tool_calls")
#: embeddings body fields the batch pipeline takes apart; the others (``user``, ...) travel as they are
_EMBEDDING_FIELDS = frozenset({"input", "model", "encoding_format", "dimensions"})


class BatchFileError(ValueError):
    """A line of a batch file is not a request; ``line`` is 1-based."""

    def __init__(self, message: str, *, line: int | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.line = line
        self.param = param


@dataclass(frozen=True)
class RequestLine:
    line: int  # 1-based line number in the file
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass(frozen=True)
class LineProblem:
    """Why a line does not fit a batch: an entry of the batch's ``errors``."""

    code: str
    message: str
    line: int
    param: str | None = None

    def as_error(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


def parse_request_lines(content: bytes) -> list[RequestLine]:
    """Every request of a batch file; raises :class:`BatchFileError` at the first line that is not one."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BatchFileError(f"the file is not UTF-8 text (byte {exc.start} is not valid UTF-8)") from None
    lines: list[RequestLine] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        request = _parse_line(raw, number)
        first = seen.get(request.custom_id)
        if first is not None:
            raise BatchFileError(
                f"line {number}: duplicate custom_id {request.custom_id!r} (first used on line {first}); "
                "every request of a batch needs its own custom_id",
                line=number, param="custom_id",
            )
        seen[request.custom_id] = number
        lines.append(request)
    if not lines:
        raise BatchFileError("the file has no requests: write one JSON request per line")
    return lines


def _parse_line(raw: str, number: int) -> RequestLine:
    try:
        data = json_limits.loads(raw)
    except json.JSONDecodeError as exc:
        raise BatchFileError(f"line {number} is not valid JSON ({exc.msg} at column {exc.colno})",
                             line=number) from None
    except json_limits.JSONLimitError as exc:
        raise BatchFileError(f"line {number}: {exc}", line=number) from None
    if not isinstance(data, dict):
        raise BatchFileError(
            f"line {number} is not a JSON object: each line must be "
            '{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions", "body": {...}}',
            line=number,
        )
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise BatchFileError(f"line {number}: custom_id must be a non-empty string", line=number, param="custom_id")
    if len(custom_id) > MAX_CUSTOM_ID:
        raise BatchFileError(f"line {number}: custom_id is longer than {MAX_CUSTOM_ID} characters",
                             line=number, param="custom_id")
    method = data.get("method")
    if method != "POST":
        raise BatchFileError(f"line {number}: method must be 'POST', not {method!r}", line=number, param="method")
    url = data.get("url")
    if url not in ENDPOINTS:
        raise BatchFileError(
            f"line {number}: url {url!r} is not supported; use one of {', '.join(ENDPOINTS)}",
            line=number, param="url",
        )
    body = data.get("body")
    if not isinstance(body, dict):
        raise BatchFileError(f"line {number}: body must be a JSON object (the request's body)",
                             line=number, param="body")
    return RequestLine(number, custom_id, url, body)


def check_lines(lines: list[RequestLine], endpoint: str) -> list[LineProblem]:
    """The lines that do not fit a batch on ``endpoint`` (at most :data:`MAX_REPORTED_ERRORS` of them); for
    embeddings also the line whose inputs take the batch past :data:`MAX_EMBEDDING_INPUTS_PER_BATCH`."""
    problems: list[LineProblem] = []
    for request in lines:
        problem = _check_line(request, endpoint)
        if problem is not None:
            problems.append(problem)
            if len(problems) >= MAX_REPORTED_ERRORS:
                return problems
    if endpoint == EMBEDDINGS and not problems:
        too_many = _too_many_inputs(lines)
        if too_many is not None:
            problems.append(too_many)
    return problems


def _check_line(request: RequestLine, endpoint: str) -> LineProblem | None:
    number, body = request.line, request.body
    if request.url != endpoint:
        return LineProblem("mismatched_endpoint", f"line {number}: url {request.url!r} does not match the batch's "
                           f"endpoint {endpoint!r}; all requests of a batch go to its endpoint", number, "url")
    if endpoint == EMBEDDINGS:
        return _check_embeddings(number, body)
    if endpoint == CHAT_COMPLETIONS:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            return LineProblem("invalid_request", f"line {number}: body.messages must be a non-empty list of "
                               "message objects", number, "body.messages")
    elif _prompt_text(body.get("prompt")) is None:
        return LineProblem("invalid_request", f"line {number}: body.prompt must be a string (or a list holding "
                           "one string)", number, "body.prompt")
    else:
        chat_only = next((f for f in _CHAT_ONLY if body.get(f) is not None), None)
        if chat_only is not None:
            return LineProblem("invalid_request", f"line {number}: body.{chat_only} is a field of "
                               f"{CHAT_COMPLETIONS}, not of {COMPLETIONS}", number, f"body.{chat_only}")
    n = body.get("n", 1)
    if n not in (None, 1):
        return LineProblem("unsupported_value", f"line {number}: body.n must be 1 in a batch on this server "
                           "(one choice per request); send several requests instead", number, "body.n")
    return None


def _check_embeddings(number: int, body: dict[str, Any]) -> LineProblem | None:
    problem = _embedding_input_problem(body.get("input"))
    if problem is not None:
        return LineProblem("invalid_request", f"line {number}: {problem}", number, "body.input")
    count = embedding_input_count(body["input"])
    if count > MAX_EMBEDDING_INPUTS_PER_LINE:
        return LineProblem("invalid_request", f"line {number}: body.input holds {count} inputs; an embeddings "
                           f"request takes at most {MAX_EMBEDDING_INPUTS_PER_LINE}: split it over several lines",
                           number, "body.input")
    if body.get("encoding_format") not in (None, "float", "base64"):
        return LineProblem("invalid_request", f"line {number}: body.encoding_format must be 'float' or 'base64', "
                           f"not {body.get('encoding_format')!r}", number, "body.encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1):
        return LineProblem("invalid_request", f"line {number}: body.dimensions must be a positive integer, not "
                           f"{dimensions!r}", number, "body.dimensions")
    return None


def _embedding_input_problem(value: Any) -> str | None:
    """Why ``value`` is not an embeddings ``input`` (None when it is one)."""
    shape = "body.input must be a string, a list of strings, a list of token ids or a list of lists of token ids"
    if isinstance(value, str):
        return None if value else "body.input is an empty string; every input needs at least one character"
    if not isinstance(value, list) or not value:
        return shape
    if all(_token(x) for x in value):
        return None
    if all(isinstance(x, str) for x in value) or all(isinstance(x, list) and all(map(_token, x)) for x in value):
        empty = next((i for i, x in enumerate(value) if not x), None)
        if empty is not None:
            return f"body.input[{empty}] is empty; every input needs at least one character or token"
        return None
    return shape + ", not a mix"


def _token(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def embedding_input_count(value: Any) -> int:
    """How many inputs an embeddings ``input`` holds (a string or one token-id list is one)."""
    if isinstance(value, str) or (isinstance(value, list) and value and isinstance(value[0], int)):
        return 1
    return len(value) if isinstance(value, list) else 0


def _too_many_inputs(lines: list[RequestLine]) -> LineProblem | None:
    total = 0
    passed_at: int | None = None
    for request in lines:
        total += embedding_input_count(request.body.get("input"))
        if passed_at is None and total > MAX_EMBEDDING_INPUTS_PER_BATCH:
            passed_at = request.line
    if passed_at is None:
        return None
    return LineProblem("too_many_inputs", f"the batch's lines hold {total} embedding inputs in all; a {EMBEDDINGS} "
                       f"batch takes at most {MAX_EMBEDDING_INPUTS_PER_BATCH:,} (line {passed_at} passes it): split "
                       "the file into several batches", passed_at, "body.input")


def _prompt_text(prompt: Any) -> str | None:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    return None


def item_of(request: RequestLine, endpoint: str) -> dict[str, Any]:
    """The job item a checked line runs as: the inputs of :class:`app.jobs.batches.pipeline.BatchRequest` (or of
    :class:`~app.jobs.batches.pipeline.BatchEmbeddingRequest` for embeddings).

    The pipeline's client speaks chat, so a ``/v1/completions`` prompt is sent as one user message."""
    body = request.body
    if endpoint == EMBEDDINGS:
        options = {key: value for key, value in body.items() if key not in _EMBEDDING_FIELDS}
        return {"custom_id": request.custom_id, "input": {
            "input": body["input"], "dimensions": body.get("dimensions"),
            "encoding_format": body.get("encoding_format") or "float", "options": options}}
    if endpoint == CHAT_COMPLETIONS:
        messages = body["messages"]
    else:
        messages = [{"role": "user", "content": _prompt_text(body.get("prompt"))}]
    options = {key: value for key, value in body.items() if key not in _NOT_OPTIONS}
    return {"custom_id": request.custom_id, "input": {"messages": messages, "options": options}}
