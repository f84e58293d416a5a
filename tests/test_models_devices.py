"""Model kinds (gpt, hf, module), precision (bf16 autocast, the fp16 scaler), gradient accumulation, activation
checkpointing, local weights, the run fingerprint and the experiment trackers: in process, on CPU."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

from p2p_diloco.config import load_config
from p2p_diloco.errors import UserError
from p2p_diloco.island.trainer import LocalTrainer, run_fingerprint
from p2p_diloco.train.metrics import MetricsWriter
from p2p_diloco.train.tokenizer import ByteTokenizer
from p2p_diloco.train.trackers import TensorBoardTracker, WandbTracker

REPO = Path(__file__).resolve().parents[1]
TINY_LLAMA = REPO / "peers" / "tiny-llama.toml"
TESTS = str(Path(__file__).resolve().parent)


def trainer(config_path: Path | None = TINY_LLAMA, **overrides) -> LocalTrainer:
    config = load_config(config_path, {"train.threads": 1, **overrides})
    local = LocalTrainer(config)
    local.open_stream("test-peer")
    return local


def weights_after(local: LocalTrainer, steps: int) -> torch.Tensor:
    local.train(steps)
    return local.weights()


def test_a_tiny_llama_from_the_shipped_config_learns() -> None:
    local = trainer()
    assert type(local.model.model).__name__ == "LlamaForCausalLM"
    before = local.evaluate()
    local.train(30)
    assert local.evaluate() < before - 0.5


@pytest.mark.parametrize("factory", ["toy_module:build", "toy_module:build_loss_only"])
def test_a_module_factory_trains(monkeypatch: pytest.MonkeyPatch, factory: str) -> None:
    monkeypatch.syspath_prepend(TESTS)
    local = trainer(None, **{"model.kind": "module", "model.factory": factory, "train.batch_size": 8})
    before = local.evaluate()
    result = local.train(40)
    assert all(map(torch.isfinite, torch.tensor(result.losses)))
    assert local.evaluate() < before - 0.5


def test_a_bad_factory_is_a_one_line_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(TESTS)
    with pytest.raises(UserError, match="returned str, not a torch nn.Module"):
        trainer(None, **{"model.kind": "module", "model.factory": "toy_module:build_nothing"})
    with pytest.raises(UserError, match="cannot be imported"):
        trainer(None, **{"model.kind": "module", "model.factory": "toy_module:missing"})


def test_bf16_autocast_on_cpu_trains_in_bf16() -> None:
    local = trainer(**{"train.precision": "bf16"})
    seen = []
    handle = local.model.model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    before = local.evaluate()
    local.train(30)
    handle.remove()
    assert set(seen) == {torch.bfloat16}
    assert local.evaluate() < before - 0.5
    assert local.weights().dtype == torch.float32  # the outer state stays fp32


def test_the_fp16_path_scales_the_loss_and_resumes_its_scale() -> None:
    local = trainer(**{"train.precision": "fp16"})
    scaler = local.precision.scaler
    assert scaler is not None and scaler.get_scale() == 65536.0
    before = local.evaluate()
    local.train(30)
    assert local.evaluate() < before - 0.3
    state = local.state_dict()
    assert "grad_scaler" in state
    other = trainer(**{"train.precision": "fp16"})
    other.load_state_dict(state)
    assert other.precision.scaler.get_scale() == scaler.get_scale()


@pytest.mark.parametrize("config_path", [TINY_LLAMA, REPO / "peers" / "tiny.toml"])
def test_gradient_accumulation_equals_one_larger_batch(config_path: Path) -> None:
    big = trainer(config_path, **{"train.batch_size": 8, "train.grad_clip": 0.0})
    small = trainer(config_path, **{"train.batch_size": 4, "train.grad_accum": 2, "train.grad_clip": 0.0})
    batches = [big.stream.next_batch() for _ in range(3)]
    halves = [(x[i : i + 4], y[i : i + 4]) for x, y in batches for i in (0, 4)]
    big.stream.next_batch = iter(batches).__next__
    small.stream.next_batch = iter(halves).__next__
    a, b = weights_after(big, 3), weights_after(small, 3)
    assert torch.allclose(a, b, atol=1e-5), float((a - b).abs().max())  # float sums in another order
    assert small.tokens == big.tokens == 3 * 8 * 32


@pytest.mark.parametrize("config_path", [TINY_LLAMA, REPO / "peers" / "tiny.toml"])
def test_activation_checkpointing_changes_no_result(config_path: Path) -> None:
    plain = trainer(config_path)
    checkpointed = trainer(config_path, **{"train.activation_checkpointing": True})
    assert torch.allclose(weights_after(plain, 5), weights_after(checkpointed, 5), atol=1e-6)


def test_init_from_local_weights(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    source = trainer()
    source.train(5)
    state = {name: tensor.contiguous() for name, tensor in source.model.model.state_dict().items()}
    state.pop("lm_head.weight")  # tied to the embedding, as save_pretrained leaves it out
    save_file(state, tmp_path / "model.safetensors")
    loaded = trainer(**{"model.init_from": str(tmp_path / "model.safetensors")})
    assert torch.equal(loaded.weights(), source.weights())
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes((tmp_path / "model.safetensors").read_bytes())
    assert torch.equal(trainer(**{"model.init_from": str(folder)}).weights(), source.weights())
    (tmp_path / "broken.safetensors").write_bytes(b"not weights")
    with pytest.raises(UserError, match="cannot be read"):
        trainer(**{"model.init_from": str(tmp_path / "broken.safetensors")})
    wide = json.loads((REPO / "peers" / "tiny-llama" / "config.json").read_text()) | {"hidden_size": 64}
    (tmp_path / "wide.json").write_text(json.dumps(wide))
    with pytest.raises(UserError, match="does not fit --model-config"):
        trainer(**{"model.config": str(tmp_path / "wide.json"), "model.init_from": str(tmp_path / "model.safetensors")})


def test_the_fingerprint_covers_the_model_config_and_the_tokenizer(tmp_path: Path) -> None:
    local = trainer()
    config = local.config
    base = run_fingerprint(local.model, config, ByteTokenizer())
    assert base == run_fingerprint(local.model, config, ByteTokenizer())
    other_tokenizer = copy.copy(ByteTokenizer())
    other_tokenizer.fingerprint = "0123456789abcdef"
    assert run_fingerprint(local.model, config, other_tokenizer) != base
    changed = json.loads((REPO / "peers" / "tiny-llama" / "config.json").read_text()) | {"rope_theta": 500000.0}
    (tmp_path / "config.json").write_text(json.dumps(changed))  # same shapes, another model
    other = trainer(**{"model.config": str(tmp_path / "config.json")})
    assert run_fingerprint(other.model, other.config, ByteTokenizer()) != base


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(300)} | {"<|endoftext|>": 300}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(UserError, match="has 301 tokens but the model embeds only 256; set vocab_size in --model"):
        trainer(**{"data.tokenizer": str(tmp_path / "tokenizer.json"), "data.cache_dir": str(tmp_path / "cache")})


def test_metrics_reach_tensorboard_and_wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    writer = MetricsWriter(tmp_path / "m.jsonl", [TensorBoardTracker(str(tmp_path / "tb")), WandbTracker("p2p-test")])
    base = {"peer_id": "QmA", "run_id": "r", "inner_steps_total": 1, "tokens": 8, "partners": 1, "wait_s": 0.1}
    base |= {"bytes_sent": 1, "bytes_recv": 1, "time": 1.0, "merged": True, "note": "x"}
    for step in (1, 2):
        writer.write(base | {"outer_step": step, "loss": 3.0 / step, "eval_loss": 2.0 / step})
    writer.close()
    events = EventAccumulator(str(tmp_path / "tb" / "QmA"))
    events.Reload()
    assert [round(event.value, 4) for event in events.Scalars("loss")] == [3.0, 1.5]
    assert "merged" not in events.Tags()["scalars"] and "time" not in events.Tags()["scalars"]
    assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb")), list(tmp_path.rglob("*"))[:20]


@pytest.mark.skipif(sys.platform != "linux", reason="torch.compile's CPU backend is exercised on Linux here")
def test_compile_trains_the_same_model() -> None:
    plain = trainer(REPO / "peers" / "tiny.toml")
    compiled = trainer(REPO / "peers" / "tiny.toml", **{"train.compile": True})
    assert torch.allclose(weights_after(plain, 3), weights_after(compiled, 3), atol=1e-4)
