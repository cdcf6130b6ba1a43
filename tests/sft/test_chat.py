"""Chat formats, templates and the exact loss mask of rendered conversations."""

import json

import numpy as np
import pytest

from forge_lightning.datamodules.chat import (
    ChatEncoder,
    ChatFormatError,
    parse_record,
    read_conversations,
    read_records,
)
from forge_lightning.datamodules.packing import best_fit_pack
from forge_lightning.datamodules.sft import load_sft_samples

ALPACA = {
    "system": "Be brief.",
    "history": [["hello there", "fine thanks"]],
    "instruction": "how are you",
    "input": "the weather",
    "output": "goodbye",
}
SHAREGPT = {
    "conversations": [
        {"from": "human", "value": "what is the weather"},
        {"from": "function_call", "value": json.dumps({"name": "weather", "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": "sunny"},
        {"from": "gpt", "value": "it is sunny"},
    ],
    "tools": json.dumps([{"name": "weather", "parameters": {"type": "object"}}]),
}
OPENAI = {
    "messages": [
        {"role": "system", "content": "You answer."},
        {"role": "user", "content": "add 2 and 3"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
            ],
        },
        {"role": "tool", "content": "5", "tool_call_id": "call_0"},
        {"role": "assistant", "content": "the sum is 5"},
    ],
    "tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
}


def _trained_texts(tokenizer, encoded):
    """Decoded text of each maximal run of trained tokens."""
    runs, current = [], []
    for token, trained in zip(encoded.tokens.tolist(), encoded.trainable.tolist()):
        if trained:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run) for run in runs]


def test_each_format_parses_to_the_same_message_shape():
    alpaca = parse_record(ALPACA)
    assert alpaca.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "fine thanks"},
        {"role": "user", "content": "how are you\n\nthe weather"},
        {"role": "assistant", "content": "goodbye"},
    ]
    sharegpt = parse_record(SHAREGPT)
    assert [m["role"] for m in sharegpt.messages] == ["user", "assistant", "tool", "assistant"]
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
    assert sharegpt.messages[1]["tool_calls"] == [call]
    assert sharegpt.tools == [{"name": "weather", "parameters": {"type": "object"}}]
    openai = parse_record(OPENAI, format="openai")
    assert openai.messages[2]["tool_calls"][0]["function"]["arguments"] == {"a": 2, "b": 3}
    assert openai.messages[3] == {"role": "tool", "content": "5", "tool_call_id": "call_0"}
    assert openai.assistant_turns == [2, 4]


def test_alpaca_mask_with_chatml_trains_exactly_the_answers(chat_tokenizer):
    encoded = ChatEncoder(chat_tokenizer, "chatml").encode(parse_record(ALPACA))
    assert _trained_texts(chat_tokenizer, encoded) == ["fine thanks<|im_end|>\n", "goodbye<|im_end|>\n"]
    text = chat_tokenizer.decode(encoded.tokens.tolist())
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello there<|im_end|>\n"
        "<|im_start|>assistant\nfine thanks<|im_end|>\n<|im_start|>user\nhow are you\n\nthe weather<|im_end|>\n"
        "<|im_start|>assistant\ngoodbye<|im_end|>\n"
    )
    last = ChatEncoder(chat_tokenizer, "chatml", train_on="last_assistant").encode(parse_record(ALPACA))
    assert _trained_texts(chat_tokenizer, last) == ["goodbye<|im_end|>\n"]
    everything = ChatEncoder(chat_tokenizer, "chatml", train_on="all").encode(parse_record(ALPACA))
    assert everything.trainable.all() and np.array_equal(everything.tokens, encoded.tokens)


def test_sharegpt_tool_call_mask_with_qwen_template(chat_tokenizer):
    encoded = ChatEncoder(chat_tokenizer, "qwen").encode(parse_record(SHAREGPT))
    assert _trained_texts(chat_tokenizer, encoded) == [
        '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n',
        "it is sunny<|im_end|>\n",
    ]
    text = chat_tokenizer.decode(encoded.tokens.tolist())
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" in text
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools")


def test_openai_tool_call_mask_with_llama3_template(chat_tokenizer):
    encoded = ChatEncoder(chat_tokenizer, "llama3").encode(parse_record(OPENAI))
    assert _trained_texts(chat_tokenizer, encoded) == [
        '{"name": "add", "parameters": {"a": 2, "b": 3}}<|eot_id|>',
        "the sum is 5<|eot_id|>",
    ]
    text = chat_tokenizer.decode(encoded.tokens.tolist())
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n5<|eot_id|>" in text


def test_tokenizer_own_template_and_labels(chat_tokenizer, write_jsonl):
    # The tokenizer's own template (tokenizer_config.json chat_template, no generation markers) is ChatML here.
    encoder = ChatEncoder(chat_tokenizer, None)
    assert encoder.template.name == "tokenizer"
    encoded = encoder.encode(parse_record(ALPACA))
    assert _trained_texts(chat_tokenizer, encoded) == ["fine thanks<|im_end|>\n", "goodbye<|im_end|>\n"]
    path = write_jsonl("a.jsonl", [ALPACA])
    dataset, _, stats = load_sft_samples([str(path)], encoder, seq_length=256)
    sample = dataset[0]
    tokens = encoded.tokens
    expected = np.where(encoded.trainable[1:], tokens[1:], -100)
    assert sample["input_ids"].tolist() == tokens[:-1].tolist()
    assert sample["labels"].tolist() == expected.tolist()
    assert stats.trained_tokens == int(encoded.trainable[1:].sum()) and stats.samples == 1


def test_truncation_dropping_and_records_without_targets_are_counted(chat_tokenizer, write_jsonl):
    long = {"instruction": "hello there " * 40, "output": "fine"}
    no_answer = {"messages": [{"role": "user", "content": "hello"}]}
    path = write_jsonl("mixed.jsonl", [ALPACA, long, no_answer, ""])
    encoder = ChatEncoder(chat_tokenizer, "chatml")
    _, _, truncated = load_sft_samples([str(path)], encoder, seq_length=40, overlong="truncate")
    # ALPACA is longer than 40 tokens too; the long prompt loses its answer to truncation and is skipped.
    assert (truncated.records, truncated.truncated, truncated.skipped_no_target, truncated.samples) == (
        3,
        2,
        2,
        1,
    )
    _, _, dropped = load_sft_samples([str(path)], encoder, seq_length=40, overlong="drop")
    assert (dropped.dropped_overlong, dropped.skipped_no_target, dropped.samples) == (2, 1, 0)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"bad\.jsonl:2: malformed JSON"),
        (
            '{"conversations": [{"from": "robot", "value": "x"}]}',
            r"bad\.jsonl:2: conversations\[0\]: unknown role",
        ),
        ('{"instruction": "x"}', r"bad\.jsonl:2: missing key 'output'"),
        ('{"text": "x"}', r"bad\.jsonl:2: unknown record format"),
        ('{"messages": [{"role": "user", "content": 3}]}', r"bad\.jsonl:2: messages\[0\] must be a string"),
    ],
)
def test_malformed_records_name_file_and_line(write_jsonl, line, message):
    path = write_jsonl("bad.jsonl", [ALPACA, line])
    with pytest.raises(ChatFormatError, match=message):
        list(read_conversations(path))


def test_a_json_list_reads_as_records_named_by_index(tmp_path):
    # The reader chat data shares with the VLM data: a .json list names its records file[index].
    path = tmp_path / "chat.json"
    path.write_text(json.dumps([ALPACA, {"instruction": "x"}]))
    first, second = read_records(path)
    assert first.source == f"{path}[0]" and first.messages[-1]["role"] == "assistant"
    assert isinstance(second, ChatFormatError) and str(second) == f"{path}[1]: missing key 'output'"
    (tmp_path / "list.json").write_text("{}")
    with pytest.raises(ValueError, match=r"list\.json: a \.json data file must hold a list of records"):
        list(read_records(tmp_path / "list.json"))


def test_best_fit_packing():
    # Best fit puts each sample in the open bin with the least room that still fits it.
    assert best_fit_pack([6, 5, 4, 3, 2, 1], 8, buffer_size=8) == [[0, 4], [1, 3], [2, 5]]
    # With one open bin, a sample that does not fit closes it.
    assert best_fit_pack([6, 5, 2, 3], 8, buffer_size=1) == [[0], [1, 2], [3]]
    with pytest.raises(ValueError, match=r"sample 1 has 9 tokens"):
        best_fit_pack([1, 9], 8)
