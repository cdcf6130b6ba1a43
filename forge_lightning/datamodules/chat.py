"""Chat data: record formats, chat templates and the loss mask of supervised fine-tuning.

A record (one JSONL line) in any supported format becomes a :class:`Conversation` of role / content messages in
the shape ``transformers``' chat templates expect, then a token sequence and a per-token *trainable* flag::

    record ─ parse_record ─ Conversation ─ render prefixes ─ segments ─ tokenize ─ tokens + trainable flags
                                            (template)       prompt │ answer │ prompt │ answer │ tail

Templates need no ``{% generation %}`` markers: the text of assistant turn ``i`` is the difference between the
rendering of the messages before it with the generation prompt and the rendering of the messages through it.
Each segment is tokenized on its own, so the prompt tokens are exactly those a generation request sees.

Formats (chosen per record, or forced with ``format``):

* ``alpaca``: ``instruction``, optional ``input`` (appended after a blank line), ``output``, optional
  ``system`` and ``history`` (a list of ``[user, assistant]`` pairs before the instruction).
* ``sharegpt``: ``conversations`` of ``{"from", "value"}`` with roles ``system``, ``human`` / ``user``,
  ``gpt`` / ``assistant``, ``function_call`` (an assistant tool call, JSON ``{"name", "arguments"}``) and
  ``observation`` / ``tool`` (a tool result); optional top-level ``system`` and ``tools``.
* ``openai``: ``messages`` of ``{"role", "content"}`` (``system`` / ``developer``, ``user``, ``assistant`` with
  optional ``tool_calls``, ``tool``) and optional top-level ``tools``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from forge_lightning.datamodules.json_records import MalformedRecord, read_json_records

FORMATS = ("auto", "alpaca", "sharegpt", "openai")
TRAIN_ON = ("assistant", "last_assistant", "all")

_SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "function_call": "assistant",
    "observation": "tool",
    "tool": "tool",
}
_OPENAI_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


class ChatFormatError(ValueError):
    """A record that cannot be read as a conversation; the message names the file and line."""


@dataclass
class Conversation:
    """Messages in ``transformers`` chat-template form plus the tools offered to the model.

    Args:
        messages: dicts with ``role`` (``system``, ``user``, ``assistant``, ``tool``) and ``content``; assistant
            tool calls are under ``tool_calls`` as ``{"type": "function", "function": {"name", "arguments"}}``.
        tools: JSON-schema tool definitions, or ``None``.
        source: where the record came from (``file:line``), for messages.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    source: str = ""

    @property
    def assistant_turns(self) -> list[int]:
        """Indices of the assistant messages."""
        return [i for i, m in enumerate(self.messages) if m["role"] == "assistant"]


# ------------------------------------------------------------------------------------------------- formats


def detect_format(record: dict[str, Any]) -> str:
    """Name the format of ``record`` from its keys (``openai``, ``sharegpt`` or ``alpaca``)."""
    if "messages" in record:
        return "openai"
    if "conversations" in record:
        return "sharegpt"
    if "instruction" in record:
        return "alpaca"
    raise ValueError(
        f"unknown record format (keys {sorted(record)}): expected 'messages' (openai), 'conversations' "
        "(sharegpt) or 'instruction' + 'output' (alpaca)"
    )


def parse_record(record: Any, format: str = "auto", source: str = "") -> Conversation:
    """Read one record as a :class:`Conversation`.

    Args:
        record: the decoded JSON object.
        format: one of :data:`FORMATS`; ``auto`` detects it from the keys.
        source: ``file:line`` of the record, prefixed to error messages.

    Raises:
        ChatFormatError: the record is not an object of the format, or a field has the wrong type or role.
    """
    if format not in FORMATS:
        raise ValueError(f"format ({format!r}) must be one of {', '.join(FORMATS)}")
    try:
        if not isinstance(record, dict):
            raise ValueError(f"a record must be a JSON object, got {type(record).__name__}")
        name = detect_format(record) if format == "auto" else format
        messages, tools = _PARSERS[name](record)
        return Conversation(messages, _tools(tools), source)
    except (ValueError, TypeError, KeyError) as error:
        detail = f"missing key {error}" if isinstance(error, KeyError) else str(error)
        raise ChatFormatError(f"{source}: {detail}" if source else detail) from None


def _text(value: Any, what: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        return "".join(p["text"] for p in value)  # OpenAI content parts (text only)
    raise TypeError(f"{what} must be a string, got {type(value).__name__}")


def _json_value(value: Any, what: str) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        raise ValueError(f"{what} is not valid JSON: {value[:80]!r}") from None


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    tools = _json_value(tools, "tools")
    if tools in (None, [], ""):
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise TypeError("tools must be a list of JSON objects")
    return tools


def _tool_call(name: str, arguments: Any) -> dict[str, Any]:
    # Chat templates render arguments with `tojson`: keep them as a mapping when the source gave a JSON string.
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _parse_alpaca(record: dict[str, Any]) -> tuple[list[dict[str, Any]], Any]:
    messages = []
    if record.get("system"):
        messages.append({"role": "system", "content": _text(record["system"], "system")})
    for k, pair in enumerate(record.get("history") or []):
        if not (isinstance(pair, list | tuple) and len(pair) == 2):
            raise TypeError(f"history[{k}] must be a [user, assistant] pair")
        messages.append({"role": "user", "content": _text(pair[0], f"history[{k}][0]")})
        messages.append({"role": "assistant", "content": _text(pair[1], f"history[{k}][1]")})
    prompt = _text(record["instruction"], "instruction")
    extra = _text(record.get("input") or "", "input")
    messages.append({"role": "user", "content": f"{prompt}\n\n{extra}" if extra else prompt})
    messages.append({"role": "assistant", "content": _text(record["output"], "output")})
    return messages, record.get("tools")


def _parse_sharegpt(record: dict[str, Any]) -> tuple[list[dict[str, Any]], Any]:
    turns = record["conversations"]
    if not isinstance(turns, list):
        raise TypeError("conversations must be a list")
    messages = []
    if record.get("system"):
        messages.append({"role": "system", "content": _text(record["system"], "system")})
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise TypeError(f"conversations[{k}] must be an object")
        speaker = turn["from"]
        if speaker not in _SHAREGPT_ROLES:
            raise ValueError(
                f"conversations[{k}]: unknown role {speaker!r}; known: {', '.join(_SHAREGPT_ROLES)}"
            )
        value = _text(turn["value"], f"conversations[{k}].value")
        if speaker == "function_call":
            calls = _json_value(value, f"conversations[{k}].value")
            calls = calls if isinstance(calls, list) else [calls]
            tool_calls = [_tool_call(c["name"], c.get("arguments", {})) for c in calls]
            messages.append({"role": "assistant", "content": "", "tool_calls": tool_calls})
        else:
            messages.append({"role": _SHAREGPT_ROLES[speaker], "content": value})
    return messages, record.get("tools")


def _parse_openai(record: dict[str, Any]) -> tuple[list[dict[str, Any]], Any]:
    raw = record["messages"]
    if not isinstance(raw, list):
        raise TypeError("messages must be a list")
    messages = []
    for k, message in enumerate(raw):
        if not isinstance(message, dict):
            raise TypeError(f"messages[{k}] must be an object")
        role = message["role"]
        if role not in _OPENAI_ROLES:
            raise ValueError(f"messages[{k}]: unknown role {role!r}; known: {', '.join(_OPENAI_ROLES)}")
        content = message.get("content")
        out = {
            "role": _OPENAI_ROLES[role],
            "content": "" if content is None else _text(content, f"messages[{k}]"),
        }
        if message.get("tool_calls"):
            out["tool_calls"] = [
                _tool_call(c["function"]["name"], c["function"].get("arguments", {}))
                for c in message["tool_calls"]
            ]
        for key in ("name", "tool_call_id"):
            if key in message:
                out[key] = message[key]
        messages.append(out)
    return messages, record.get("tools")


_PARSERS: dict[str, Callable[[dict[str, Any]], tuple[list[dict[str, Any]], Any]]] = {
    "alpaca": _parse_alpaca,
    "sharegpt": _parse_sharegpt,
    "openai": _parse_openai,
}


def read_conversations(path: str | Path, format: str = "auto") -> Iterator[Conversation]:
    """Yield the conversations of a JSONL file (blank lines skipped) or of a ``.json`` list.

    Raises:
        ChatFormatError: malformed JSON or record, naming ``file:line``.
    """
    for record in read_records(path, format):
        if isinstance(record, ChatFormatError):
            raise record
        yield record


def read_records(path: str | Path, format: str = "auto") -> Iterator[Conversation | ChatFormatError]:
    """Yield each record of a JSONL file (or a ``.json`` list) as a conversation, or as the error (naming
    ``file:line``) that it cannot be read: every record is looked at, so a checker can report all problems at once."""
    for source, record in read_json_records(path):
        if isinstance(record, MalformedRecord):
            yield ChatFormatError(str(record))
            continue
        try:
            yield parse_record(record, format, source)
        except ChatFormatError as error:
            yield error


# ------------------------------------------------------------------------------------------------ templates


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template with the special tokens it relies on.

    Args:
        name: the template's name.
        source: Jinja text in ``transformers``' chat-template dialect.
        special_tokens: tokens the template emits that must be single tokens of the vocabulary.
        stop: the end-of-turn string that ends an assistant answer (generation stops on it).
    """

    name: str
    source: str
    special_tokens: tuple[str, ...] = ()
    stop: str | None = None


# Templates follow transformers' conventions (trim_blocks, lstrip_blocks): control tags are whitespace-trimmed and
# every literal that ends in a newline is written as a string expression, so the rendered text is exact.
# Tool calls are rendered as JSON objects {"name", "arguments"}, the convention of ChatML-style models.
_TOOL_CALLS = """
{%- for call in message.tool_calls %}
{%- if not loop.first or message.content %}{{ '\\n' }}{% endif %}
{{- '<tool_call>\\n' + ({'name': call.function.name, 'arguments': call.function.arguments} | tojson) + '\\n</tool_call>' }}
{%- endfor %}"""

_CHATML = (
    """
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages and messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{% endif %}
{{- 'You can call these tools:\\n' + (tools | tojson) + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if not (tools and loop.first and message.role == 'system') %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}
{%- if message.tool_calls %}"""
    + _TOOL_CALLS
    + """{% endif %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"""
)

_QWEN = (
    """
{%- if messages and messages[0].role == 'system' %}{% set system = messages[0].content %}
{%- else %}{% set system = 'You are a helpful assistant.' %}{% endif %}
{{- '<|im_start|>system\\n' + system }}
{%- if tools %}
{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within ' }}
{{- '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}' }}
{{- '\\n</tool_call>' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in messages %}
{%- if message.role == 'tool' %}
{%- if loop.first or loop.previtem.role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or loop.nextitem.role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}
{%- elif not (loop.first and message.role == 'system') %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}
{%- if message.tool_calls %}"""
    + _TOOL_CALLS
    + """{% endif %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"""
)

_LLAMA3 = """
{{- bos_token or '' }}
{%- if tools %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if messages and messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{% endif %}
{{- 'You have access to the following functions. To call a function, respond with JSON ' }}
{{- '{"name": function name, "parameters": dictionary of argument name and its value}.\\n\\n' }}
{%- for tool in tools %}{{ (tool | tojson) + '\\n\\n' }}{% endfor %}
{{- '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
{%- if not (tools and loop.first and message.role == 'system') %}
{{- '<|start_header_id|>' + ('ipython' if message.role == 'tool' else message.role) + '<|end_header_id|>\\n\\n' }}
{%- if message.tool_calls %}
{%- for call in message.tool_calls %}
{{- {'name': call.function.name, 'parameters': call.function.arguments} | tojson }}
{%- endfor %}
{%- else %}{{ message.content or '' }}{% endif %}
{{- '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"""

BUILTIN_TEMPLATES: dict[str, ChatTemplate] = {
    "chatml": ChatTemplate(
        name="chatml", source=_CHATML, special_tokens=("<|im_start|>", "<|im_end|>"), stop="<|im_end|>"
    ),
    "qwen": ChatTemplate(
        name="qwen", source=_QWEN, special_tokens=("<|im_start|>", "<|im_end|>"), stop="<|im_end|>"
    ),
    "llama3": ChatTemplate(
        name="llama3",
        source=_LLAMA3,
        special_tokens=("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        stop="<|eot_id|>",
    ),
}
"""Built-in templates, usable with any tokenizer (whose own template, if any, is then ignored)."""


def resolve_template(template: str | None, tokenizer: Any) -> ChatTemplate:
    """The template to render with: a built-in name, a ``.jinja`` file, or (``None``) the tokenizer's own.

    Args:
        template: ``None``, a name in :data:`BUILTIN_TEMPLATES` or a path to a Jinja file.
        tokenizer: a ``transformers`` tokenizer (its ``chat_template`` is used when ``template`` is ``None``).

    Raises:
        ValueError: no template given and the tokenizer has none, or an unknown name.
    """
    if template is None:
        own = getattr(tokenizer, "chat_template", None)
        if not own:
            raise ValueError(
                "the tokenizer has no chat template (chat_template in tokenizer_config.json): set `template` "
                f"to one of {', '.join(BUILTIN_TEMPLATES)} or to a .jinja file"
            )
        if isinstance(own, dict):
            own = own.get("default") or next(iter(own.values()))
        eos = getattr(tokenizer, "eos_token", None)
        return ChatTemplate(name="tokenizer", source=own, stop=eos if isinstance(eos, str) else None)
    if template in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[template]
    if Path(template).is_file():
        return ChatTemplate(name=Path(template).stem, source=Path(template).read_text(encoding="utf-8"))
    raise ValueError(
        f"template ({template!r}) is neither a built-in ({', '.join(BUILTIN_TEMPLATES)}) nor a file"
    )


# --------------------------------------------------------------------------------------------- tokenizing


@dataclass
class TokenizedConversation:
    """Token ids of a rendered conversation and which of them are trained.

    Args:
        tokens: token ids ``[n]``.
        trainable: ``True`` where the token is a target of the loss ``[n]``.
        segments: ``(start token, end token, trained)`` of each rendered segment, for display.
    """

    tokens: np.ndarray
    trainable: np.ndarray
    segments: list[tuple[int, int, bool]] = field(default_factory=list)


class ChatEncoder:
    """Renders conversations with a chat template and tokenizes them with their loss mask.

    Args:
        tokenizer: a ``transformers`` tokenizer (``apply_chat_template`` renders the template).
        template: see :func:`resolve_template`.
        train_on: ``assistant`` (every assistant turn), ``last_assistant`` (the final one only) or ``all``
            (every token, prompt included).
    """

    def __init__(self, tokenizer: Any, template: str | None = None, *, train_on: str = "assistant") -> None:
        if train_on not in TRAIN_ON:
            raise ValueError(f"train_on ({train_on!r}) must be one of {', '.join(TRAIN_ON)}")
        if not hasattr(tokenizer, "apply_chat_template"):
            raise TypeError(
                f"{type(tokenizer).__name__} cannot render chat templates; load a transformers tokenizer"
            )
        self.tokenizer = tokenizer
        self.template = resolve_template(template, tokenizer)
        self.train_on = train_on

    def render(
        self, conversation: Conversation, upto: int | None = None, *, generation_prompt: bool = False
    ) -> str:
        """Template text of the first ``upto`` messages (all by default)."""
        messages = conversation.messages if upto is None else conversation.messages[:upto]
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=conversation.tools,
                chat_template=self.template.source,
                add_generation_prompt=generation_prompt,
                tokenize=False,
            )
        except Exception as error:  # jinja2's and transformers' own errors
            raise ChatFormatError(
                f"{conversation.source}: template {self.template.name!r} cannot render "
                f"{'the conversation' if upto is None else f'its first {upto} message(s)'}: {error}"
            ) from error

    def assistant_spans(self, conversation: Conversation) -> tuple[str, list[tuple[int, int]]]:
        """The full text and the character span ``[start, end)`` of each assistant turn in it.

        Raises:
            ValueError: the template renders a conversation prefix that is not a prefix of the full text (e.g.
                it rewrites earlier turns once a later one exists), so turns cannot be located.
        """
        full = self.render(conversation)
        spans = []
        if conversation.assistant_turns[:1] == [0]:
            raise ChatFormatError(
                f"{conversation.source}: the conversation starts with an assistant turn; put a system or user "
                "message (the prompt it answers) first"
            )
        for i in conversation.assistant_turns:
            through = self.render(conversation, i + 1)
            before = self.render(conversation, i, generation_prompt=True)
            if not through.startswith(before):
                # The generation prompt differs from the header the template writes before an answer: fall back
                # to the text before the turn (the header is then trained too).
                before = self.render(conversation, i)
            if not (full.startswith(through) and through.startswith(before)):
                raise ValueError(
                    f"{conversation.source}: template {self.template.name!r} does not render conversation "
                    f"prefixes as prefixes of the full text (at message {i}), so assistant turns cannot be found"
                )
            spans.append((len(before), len(through)))
        return full, spans

    def encode(self, conversation: Conversation) -> TokenizedConversation:
        """Tokenize ``conversation`` segment by segment and flag the tokens the loss trains on."""
        full, spans = self.assistant_spans(conversation)
        if self.train_on == "last_assistant":
            spans = spans[-1:]
        cuts, position = [], 0
        for start, end in spans:
            cuts += [(position, start, self.train_on == "all"), (start, end, True)]
            position = end
        cuts.append((position, len(full), self.train_on == "all"))
        tokens: list[int] = []
        trainable: list[bool] = []
        segments = []
        for start, end, trained in cuts:
            if start == end:
                continue
            ids = self.tokenizer.encode(full[start:end], add_special_tokens=False)
            segments.append((len(tokens), len(tokens) + len(ids), trained))
            tokens += ids
            trainable += [trained] * len(ids)
        return TokenizedConversation(np.asarray(tokens, np.int64), np.asarray(trainable, bool), segments)

    def prompt_and_answer(self, conversation: Conversation) -> tuple[list[int], str]:
        """Token ids of the prompt before the last assistant turn (with the generation prompt) and that turn's text.

        The reference answer is the turn's ``content``; tool-call turns have none and give ``""``.
        """
        turns = conversation.assistant_turns
        if not turns:
            raise ValueError(f"{conversation.source}: the conversation has no assistant turn to answer")
        prompt = self.render(conversation, turns[-1], generation_prompt=True)
        answer = conversation.messages[turns[-1]]["content"] or ""
        return self.tokenizer.encode(prompt, add_special_tokens=False), answer

    def stop_token_ids(self) -> list[int]:
        """Ids that end a generated answer: the template's end-of-turn token and the tokenizer's EOS.

        A template without a declared stop string (e.g. the tokenizer's own) gets the first special token it
        writes right after an assistant answer.
        """
        vocab = self.tokenizer.get_vocab()
        ids = [self._end_of_turn()] if self.template.stop is None or self.template.name == "tokenizer" else []
        for token in (self.template.stop, self.tokenizer.eos_token):
            if isinstance(token, str) and token in vocab:
                ids.append(vocab[token])
        return list(dict.fromkeys(i for i in ids if i is not None))

    def _end_of_turn(self) -> int | None:
        probe = Conversation([{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}])
        text = self.render(probe)
        after = text[text.rindex("pong") + len("pong") :]
        special = set(self.tokenizer.all_special_ids) | set(self.tokenizer.added_tokens_decoder)
        return next((i for i in self.tokenizer.encode(after, add_special_tokens=False) if i in special), None)


def add_chat_template(tokenizer_dir: str | Path, template: str, *, eos_is_stop: bool = True) -> None:
    """Give a tokenizer directory a built-in chat template: its special tokens and ``chat_template``.

    Adds the template's special tokens to ``tokenizer.json`` (as special, never-split tokens) and writes
    ``chat_template`` into ``tokenizer_config.json``; with ``eos_is_stop`` the template's end-of-turn token
    becomes the EOS token, so generation stops at the end of an answer.

    Args:
        tokenizer_dir: a directory written by ``train_bpe_tokenizer`` or a Hugging Face tokenizer directory.
        template: a name in :data:`BUILTIN_TEMPLATES`.
        eos_is_stop: make the template's stop token the tokenizer's ``eos_token``.
    """
    from tokenizers import AddedToken, Tokenizer

    spec = BUILTIN_TEMPLATES[template]
    directory = Path(tokenizer_dir)
    backend = Tokenizer.from_file(str(directory / "tokenizer.json"))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec.special_tokens])
    backend.save(str(directory / "tokenizer.json"))
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    config["chat_template"] = spec.source
    if eos_is_stop and spec.stop is not None:
        config["eos_token"] = spec.stop
    config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    special_map = directory / "special_tokens_map.json"
    if eos_is_stop and spec.stop is not None and special_map.is_file():
        tokens = json.loads(special_map.read_text(encoding="utf-8"))
        tokens["eos_token"] = spec.stop
        special_map.write_text(json.dumps(tokens, indent=2) + "\n", encoding="utf-8")
