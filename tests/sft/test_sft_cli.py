"""The SFT commands: quick-start data, `forge-data sft --check`, and `forge validate` with exact match."""

import json
from pathlib import Path

import pytest
import yaml
from lightning.pytorch import Trainer

from forge_lightning.callbacks.exact_match import GenerationMetric
from forge_lightning.cli import ForgeCLI
from forge_lightning.datamodules.chat import ChatEncoder, read_conversations
from forge_lightning.datamodules.sft import SFTDataModule
from forge_lightning.datamodules.tokenizer import load_tokenizer
from forge_lightning.datamodules.unit_dialogues import final_question
from forge_lightning.modules.llm import CausalLM
from forge_lightning.tools.data import main as forge_data

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def quickstart_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_quickstart")
    forge_data(["sft-quickstart", "--output", str(root), "--num-train", "300", "--num-val", "24"])
    return root


def test_quickstart_data_has_a_disjoint_held_out_split_in_every_format(quickstart_data):
    train = [json.loads(line) for line in (quickstart_data / "train.jsonl").read_text().splitlines()]
    val = [json.loads(line) for line in (quickstart_data / "val.jsonl").read_text().splitlines()]
    assert (len(train), len(val)) == (300, 24)
    assert not {final_question(r) for r in train} & {final_question(r) for r in val}
    assert {next(iter(k for k in r if k in ("instruction", "conversations", "messages"))) for r in train} == {
        "instruction",
        "conversations",
        "messages",
    }
    tokenizer = load_tokenizer(quickstart_data / "tokenizer").backend
    encoder = ChatEncoder(tokenizer)
    assert encoder.stop_token_ids() == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    # Digits are single tokens, so numbers are copied digit by digit.
    assert len(tokenizer.encode("1234567890", add_special_tokens=False)) == 10
    conversation = next(read_conversations(quickstart_data / "val.jsonl"))
    prompt, answer = encoder.prompt_and_answer(conversation)
    assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")
    assert answer == conversation.messages[-1]["content"]


def test_sft_check_prints_rendered_samples(quickstart_data, capsys):
    forge_data(
        [
            "sft",
            "--check",
            str(quickstart_data / "train.jsonl"),
            "--tokenizer",
            str(quickstart_data / "tokenizer"),
            "--num",
            "2",
        ]
    )
    out = capsys.readouterr().out
    assert out.count("sample ") == 2 and "train.jsonl:1" in out and "<|im_start|>assistant" in out
    bad = quickstart_data / "bad.jsonl"
    bad.write_text('{"conversations": [{"from": "robot", "value": "x"}]}\n')
    with pytest.raises(SystemExit, match=r"bad\.jsonl:1: conversations\[0\]: unknown role 'robot'"):
        forge_data(["sft", "--check", str(bad), "--tokenizer", str(quickstart_data / "tokenizer")])


def test_validate_reports_masked_loss_and_exact_match(quickstart_data, tiny_config):
    data = SFTDataModule(
        str(quickstart_data / "train.jsonl"),
        str(quickstart_data / "tokenizer"),
        val_files=str(quickstart_data / "val.jsonl"),
        seq_length=128,
        batch_size=8,
        num_workers=0,
        pin_memory=False,
    )
    metric = GenerationMetric(max_new_tokens=4, num_samples=10)
    trainer = Trainer(accelerator="cpu", logger=False, callbacks=[metric], enable_progress_bar=False)
    result = trainer.validate(CausalLM.from_config(tiny_config), data, verbose=False)[0]
    assert result["val/loss"] > 5 and result["val/exact_match"] == 0.0
    assert metric.history == [(0, 0.0)]
    assert data.stats["val"].trained_tokens < data.stats["val"].tokens  # the loss is masked


def test_the_sft_quickstart_config_parses(capsys):
    with pytest.raises(SystemExit):
        ForgeCLI(args=["fit", "--config", str(REPO / "configs/quickstart/sft.yaml"), "--print_config"])
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["data"]["init_args"]["pack"] is True


def test_sft_check_reports_every_bad_record_with_its_line(quickstart_data, capsys):
    good = (quickstart_data / "train.jsonl").read_text().splitlines()[0]
    lines = [
        good,
        '{"conversations": [{"from": "robot", "value": "x"}]}',
        '{"messages": [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"}]}',
        good,
        '{"messages": [',
    ]
    mixed = quickstart_data / "mixed.jsonl"
    mixed.write_text("\n".join(lines) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        forge_data(["sft", "--check", str(mixed), "--tokenizer", str(quickstart_data / "tokenizer")])
    message = str(exit_info.value)
    assert "3 problem(s) in 5 records" in message, message
    assert "mixed.jsonl:2: conversations[0]: unknown role 'robot'" in message
    assert "mixed.jsonl:3: the conversation starts with an assistant turn" in message
    assert "mixed.jsonl:5: malformed JSON" in message
    assert capsys.readouterr().out.count("sample ") == 2  # the two good records are shown


def test_training_names_the_record_a_template_cannot_render(quickstart_data, tmp_path):
    bad = tmp_path / "assistant_first.jsonl"
    bad.write_text('{"messages": [{"role": "assistant", "content": "hello"}]}\n')
    data = SFTDataModule(str(bad), str(quickstart_data / "tokenizer"), seq_length=64, batch_size=1)
    with pytest.raises(
        ValueError, match=r"assistant_first\.jsonl:1: the conversation starts with an assistant"
    ):
        data.setup("fit")
