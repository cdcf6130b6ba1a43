"""The feature cache with real frozen modules saved to a temporary directory (a tokenizer, a tiny random
transformers ``UMT5EncoderModel``, a tiny random diffusers ``AutoencoderKLWan``) over mp4 clips written with PyAV:
the cached features equal the modules run online on the same batches exactly, and the cache's training batches
equal the online pipeline's (exactly in precompute order; shuffled, within the VAE's batch-composition noise); an
interrupted precompute resumes to the same files; a cache of other modules, other data, an incomplete one or a
damaged shard is refused with the file named; ``forge-data precompute`` writes the same cache from YAML."""

from __future__ import annotations

import functools
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from diffusers import AutoencoderKLWan
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

from forge_lightning.datamodules import feature_cache
from forge_lightning.datamodules.diffusion import (
    GroupedStepLoader,
    VideoCaptionConfig,
    VideoDiffusionDataModule,
    video_caption_collate,
)
from forge_lightning.datamodules.feature_cache import (
    CacheError,
    FeatureCacheDataset,
    FrozenModule,
    cache_collate,
    plan_shards,
    precompute,
)
from forge_lightning.sim.video import write_video
from forge_lightning.tools.data import main as forge_data

WORDS = ["<pad>", "<unk>", "</s>", "a", "wide", "tall", "clip", "of", "the", "sea", "sky"]
CAPTIONS = ["a wide clip", "a tall clip", "a wide clip of the sea", "the sky", "a tall clip of the sky"]
SIZES = [(20, 32), (32, 20), (24, 36), (20, 30), (36, 24)]  # height, width: two buckets
BUCKETS = [[5, 16, 24], [5, 24, 16]]
MAX_LENGTH = 8
SETTINGS = dict(batch_size=2, samples_per_shard=1, keep=["caption"])  # 3 shards: 2 + 1 + 2 samples


def _write_encoders(root: Path) -> Path:
    vocabulary = {w: i for i, w in enumerate(WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", unk_token="<unk>", eos_token="</s>"
    )
    fast.save_pretrained(root / "tokenizer")
    torch.manual_seed(0)
    config = UMT5Config(vocab_size=len(WORDS), d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=4)
    UMT5EncoderModel(config).save_pretrained(root / "umt5")
    vae = AutoencoderKLWan(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    )
    vae.save_pretrained(root / "vae")
    return root


def module_configs(root: Path, max_length: int = MAX_LENGTH) -> list[dict]:
    """The YAML entries of the three frozen modules (the real library classes, no adapter)."""
    return [
        {
            "name": "tokenizer",
            "target": "transformers.AutoTokenizer.from_pretrained",
            "init_args": {"pretrained_model_name_or_path": str(root / "tokenizer")},
            "inputs": {"text": "caption"},
            "call_args": {
                "padding": "max_length",
                "max_length": max_length,
                "truncation": True,
                "return_tensors": "pt",
            },
            "outputs": {"input_ids": "input_ids", "attention_mask": "attention_mask"},
        },
        {
            "name": "text_encoder",
            "target": "transformers.UMT5EncoderModel.from_pretrained",
            "init_args": {"pretrained_model_name_or_path": str(root / "umt5")},
            "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask"},
            "outputs": {"text_embeddings": "last_hidden_state"},
        },
        {
            "name": "vae",
            "target": "diffusers.AutoencoderKLWan.from_pretrained",
            "init_args": {"pretrained_model_name_or_path": str(root / "vae")},
            "method": "encode",
            "inputs": {"x": "video"},
            "outputs": {"latents": "latent_dist.mean"},
        },
    ]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Clips, captions, encoders, the data config and a cache built with the Python API."""
    root = tmp_path_factory.mktemp("cache")
    rng = np.random.default_rng(0)
    records = []
    for k, ((height, width), caption) in enumerate(zip(SIZES, CAPTIONS)):
        frames = [rng.integers(0, 255, (height, width, 3), dtype=np.uint8) for _ in range(9)]
        write_video(root / f"clip{k}.mp4", frames, fps=16, min_size=1)
        records.append(json.dumps({"video": f"clip{k}.mp4", "caption": caption}))
    (root / "captions.jsonl").write_text("\n".join(records) + "\n")
    _write_encoders(root)
    data = {"entries": [str(root / "captions.jsonl")], "buckets": BUCKETS, "fps": 8, "spatial_stride": 8}
    dataset, _ = VideoCaptionConfig(**data).load()
    modules = [FrozenModule.from_config(m) for m in module_configs(root)]
    precompute(
        dataset, modules, root / "features", collate_fn=video_caption_collate, log=lambda _: None, **SETTINGS
    )
    return {"root": root, "data": data, "dataset": dataset, "modules": modules, "cache": root / "features"}


@functools.cache
def _loaded(root: Path) -> tuple:
    return (
        AutoTokenizer.from_pretrained(root / "tokenizer"),
        UMT5EncoderModel.from_pretrained(root / "umt5").eval(),
        AutoencoderKLWan.from_pretrained(root / "vae").eval(),
    )


def online(root: Path, batch: dict) -> dict:
    """The frozen modules called directly on a batch: the online pipeline."""
    tokenizer, text, vae = _loaded(root)
    tokens = tokenizer(
        batch["caption"], padding="max_length", max_length=MAX_LENGTH, truncation=True, return_tensors="pt"
    )
    with torch.inference_mode():
        return {
            "input_ids": tokens["input_ids"],
            "attention_mask": tokens["attention_mask"],
            "text_embeddings": text(**tokens).last_hidden_state,
            "latents": vae.encode(batch["video"]).latent_dist.mean,
            "caption": batch["caption"],
        }


def test_cached_features_equal_the_online_modules(setup):
    dataset, cache = (
        setup["dataset"],
        FeatureCacheDataset(setup["cache"], modules=setup["modules"], dataset=setup["dataset"]),
    )
    assert len(cache) == 5 and cache.manifest["fields"]["latents"] == {
        "dtype": "F32",
        "shapes": {"[4, 2, 2, 3]": 3, "[4, 2, 3, 2]": 2},
    }
    groups = [dataset.group(i) for i in range(len(dataset))]
    for shard in plan_shards(groups, batch_size=2, samples_per_shard=1):
        for batch in shard:
            expected = online(setup["root"], video_caption_collate([dataset[i] for i in batch]))
            for row, index in enumerate(batch):
                item = cache[index]
                assert item["caption"] == expected["caption"][row]
                for name in ("input_ids", "attention_mask", "text_embeddings", "latents"):
                    assert torch.equal(item[name], expected[name][row]), name


@pytest.mark.parametrize("shuffle", [False, True])
def test_cache_batches_equal_the_online_pipeline_batches(setup, shuffle):
    options = dict(batch_size=2, seed=5, shuffle=shuffle, label_key=None)
    cache = FeatureCacheDataset(setup["cache"], modules=setup["modules"])
    cached = list(GroupedStepLoader(cache, collate_fn=cache_collate, **options))
    videos = list(GroupedStepLoader(setup["dataset"], collate_fn=video_caption_collate, **options))
    assert len(cached) == len(videos) == 2
    for got, batch in zip(cached, videos):
        expected = online(setup["root"], batch)
        assert got["caption"] == expected["caption"]
        for name in ("input_ids", "attention_mask", "text_embeddings"):
            assert torch.equal(got[name], expected[name])
        # shuffled, a batch may hold other samples than at precompute: the VAE's convolutions then differ in the
        # last bits (measured: 2.2e-7 on latents of magnitude 0.5)
        atol = 1e-6 if shuffle else 0.0
        torch.testing.assert_close(got["latents"], expected["latents"], rtol=0, atol=atol)


def test_an_interrupted_precompute_resumes_to_the_same_files(setup, tmp_path, monkeypatch):
    output, real = tmp_path / "features", feature_cache.write_file
    writes = []

    def killed_on_the_third_shard(path, write, *args, **kwargs):
        writes.append(Path(path).name)
        if len(writes) < 3:
            return real(path, write, *args, **kwargs)

        def half(stream):
            content = io.BytesIO()
            write(content)
            stream.write(content.getvalue()[:200])
            raise KeyboardInterrupt

        return real(path, half)

    run = dict(collate_fn=video_caption_collate, log=lambda _: None, **SETTINGS)
    monkeypatch.setattr(feature_cache, "write_file", killed_on_the_third_shard)
    with pytest.raises(KeyboardInterrupt):
        precompute(setup["dataset"], setup["modules"], output, **run)
    monkeypatch.setattr(feature_cache, "write_file", real)
    assert sorted(p.name for p in output.iterdir()) == ["shard-00000.safetensors", "shard-00001.safetensors"]
    with pytest.raises(
        CacheError,
        match=r"has no cache\.json: the feature cache is missing or incomplete.*forge-data precompute",
    ):
        FeatureCacheDataset(output)
    summary = precompute(setup["dataset"], setup["modules"], output, **run)
    assert (summary.shards_kept, summary.shards_written) == (2, 1)
    uninterrupted = sorted(setup["cache"].iterdir())
    assert [p.name for p in sorted(output.iterdir())] == [p.name for p in uninterrupted]
    for path in uninterrupted:
        assert (output / path.name).read_bytes() == path.read_bytes(), path.name
    assert precompute(setup["dataset"], setup["modules"], output, **run).shards_written == 0


def test_a_cache_of_other_modules_or_data_is_refused(setup, tmp_path):
    changed = [FrozenModule.from_config(m) for m in module_configs(setup["root"], max_length=6)]
    with pytest.raises(
        CacheError,
        match=r"other frozen modules .*differing: tokenizer.*rebuild it with `forge-data precompute",
    ):
        FeatureCacheDataset(setup["cache"], modules=changed)
    # the weights' identity is their files' content, read without loading them
    copy = tmp_path / "umt5"
    shutil.copytree(setup["root"] / "umt5", copy)
    module = FrozenModule.from_config(
        {**module_configs(setup["root"])[1], "init_args": {"pretrained_model_name_or_path": str(copy)}}
    )
    before = module.fingerprint()
    torch.manual_seed(1)
    UMT5EncoderModel(UMT5EncoderModel.from_pretrained(copy).config).save_pretrained(copy)
    assert module.fingerprint() != before
    subset = VideoCaptionConfig(**setup["data"]).load()[0]
    subset.samples = subset.samples[:4]
    with pytest.raises(CacheError, match="computed from other data than the configured dataset"):
        FeatureCacheDataset(setup["cache"], dataset=subset)


def test_a_truncated_or_corrupted_shard_is_named(setup, tmp_path):
    cache = tmp_path / "features"
    shutil.copytree(setup["cache"], cache)
    first = cache / "shard-00000.safetensors"
    data = bytearray(first.read_bytes())
    data[-3] ^= 0xFF  # same size, other bytes
    first.write_bytes(bytes(data))
    dataset = FeatureCacheDataset(cache)
    index = next(i for i, s in enumerate(dataset.samples) if s["shard"] == 0)
    with pytest.raises(
        CacheError, match=r"shard .*shard-00000\.safetensors does not match its hash .*forge-data precompute"
    ):
        dataset[index]
    second = cache / "shard-00001.safetensors"
    second.write_bytes(second.read_bytes()[:-10])
    with pytest.raises(
        CacheError,
        match=r"shard .*shard-00001\.safetensors is \d+ bytes, the manifest says \d+ bytes \(truncated",
    ):
        FeatureCacheDataset(cache)


def test_forge_data_precompute_writes_the_same_cache(setup, tmp_path, capsys):
    config = tmp_path / "precompute.yaml"
    config.write_text(
        yaml.safe_dump(
            {"data": setup["data"], "modules": module_configs(setup["root"]), "device": "cpu", **SETTINGS}
        )
    )
    output = tmp_path / "features"
    assert forge_data(["precompute", "--config", str(config), "--output", str(output)]) == 0
    for path in sorted(setup["cache"].iterdir()):
        assert (output / path.name).read_bytes() == path.read_bytes(), path.name
    printed = capsys.readouterr().out
    assert "5 of 5 samples kept" in printed and "3 shard(s) written" in printed
    forge_data(["precompute", "--config", str(config), "--output", str(output)])
    assert "0 shard(s) written, 3 kept" in capsys.readouterr().out
    config.write_text(yaml.safe_dump({"data": setup["data"]}))
    with pytest.raises(SystemExit, match="forge-data precompute: error: .*needs data and modules sections"):
        forge_data(["precompute", "--config", str(config), "--output", str(output)])


def test_the_datamodule_trains_from_the_cache(setup, tmp_path):
    config = tmp_path / "precompute.yaml"
    config.write_text(
        yaml.safe_dump({"data": setup["data"], "modules": module_configs(setup["root"]), **SETTINGS})
    )
    options = dict(batch_size=2, num_workers=0, pin_memory=False)
    datamodule = VideoDiffusionDataModule(cache=str(setup["cache"]), cache_config=str(config), **options)
    datamodule.setup("fit")
    expected = GroupedStepLoader(
        FeatureCacheDataset(setup["cache"]), collate_fn=cache_collate, seed=1234, label_key=None, batch_size=2
    )
    for got, want in zip(datamodule.train_dataloader(), expected, strict=True):
        assert got["caption"] == want["caption"] and torch.equal(got["latents"], want["latents"])
    # with the data given too, the cache must be of it
    checked = VideoDiffusionDataModule(
        VideoCaptionConfig(**setup["data"]), cache=str(setup["cache"]), cache_config=str(config), **options
    )
    checked.setup("fit")
    config.write_text(
        yaml.safe_dump({"data": setup["data"], "modules": module_configs(setup["root"], max_length=6)})
    )
    with pytest.raises(CacheError, match="differing: tokenizer"):
        VideoDiffusionDataModule(cache=str(setup["cache"]), cache_config=str(config), **options).setup("fit")


class Captions(torch.utils.data.Dataset):
    """Captions only, no groups: the cache's generic path."""

    def __len__(self) -> int:
        return len(CAPTIONS)

    def __getitem__(self, index: int) -> dict:
        return {"caption": CAPTIONS[index]}

    def sample_id(self, index: int) -> str:
        return f"caption {index}"

    def fingerprint(self) -> dict:
        return {"captions": CAPTIONS}


def test_outputs_are_stored_in_the_configured_dtype(setup, tmp_path):
    tokenizer, text_encoder = module_configs(setup["root"])[:2]
    modules = [
        FrozenModule.from_config({**tokenizer, "store": False}),
        FrozenModule.from_config({**text_encoder, "dtype": "bfloat16"}),
    ]
    collate = lambda samples: {"caption": [s["caption"] for s in samples]}  # noqa: E731
    precompute(Captions(), modules, tmp_path, collate_fn=collate, batch_size=5, log=lambda _: None)
    cache = FeatureCacheDataset(tmp_path, modules=modules, dataset=Captions())
    assert set(cache.manifest["fields"]) == {"text_embeddings"}
    assert cache.manifest["fields"]["text_embeddings"] == {"dtype": "BF16", "shapes": {"[8, 16]": 5}}
    tokenize, text, _ = _loaded(setup["root"])
    tokens = tokenize(
        CAPTIONS, padding="max_length", max_length=MAX_LENGTH, truncation=True, return_tensors="pt"
    )
    with torch.inference_mode():
        expected = text(**tokens).last_hidden_state
    for index in range(5):
        assert torch.equal(cache[index]["text_embeddings"], expected[index].to(torch.bfloat16))


def test_a_module_config_names_its_errors(setup, tmp_path):
    with pytest.raises(
        ValueError, match="target 'transformers.NoSuchModel.from_pretrained' names nothing importable"
    ):
        FrozenModule(
            name="x", target="transformers.NoSuchModel.from_pretrained", inputs={"a": "b"}, outputs={"c": ""}
        ).build()
    with pytest.raises(ValueError, match="'x': dtype 'float77' is not a torch dtype"):
        FrozenModule(
            name="x", target="torch.nn.Identity", inputs={"a": "b"}, outputs={"c": ""}, dtype="float77"
        )
    with pytest.raises(ValueError, match="frozen module 'x': .*unexpected keyword argument 'input'"):
        FrozenModule.from_config({"name": "x", "target": "torch.nn.Identity", "input": {}, "outputs": ["c"]})
    # from_pretrained(repo, subfolder=...): only that part's files are the weights' identity
    (tmp_path / "repo").mkdir()
    shutil.copytree(setup["root"] / "vae", tmp_path / "repo" / "vae")
    module = FrozenModule.from_config(
        {
            **module_configs(setup["root"])[2],
            "init_args": {"pretrained_model_name_or_path": str(tmp_path / "repo"), "subfolder": "vae"},
        }
    )
    before = module.fingerprint()
    (tmp_path / "repo" / "transformer.safetensors").write_bytes(b"other part")
    assert module.fingerprint() == before
    (tmp_path / "repo" / "vae" / "config.json").write_text("{}")
    assert module.fingerprint() != before
