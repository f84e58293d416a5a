"""Getting the model out: export a checkpoint, load it in plain transformers, evaluate it, pull it from a swarm.

Nothing is downloaded: the tokenizer is trained here on Python's standard library, the model is the shipped tiny
Llama config widened to that tokenizer's vocabulary.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, LocalSwarm, wait_until

from p2p_diloco.cli.export import checkpoint_model
from p2p_diloco.train.checkpoint import latest_checkpoint, load_checkpoint

STDLIB = sorted(Path(os.__file__).parent.glob("*.py"))[:40]
TINY_LLAMA = REPO / "peers" / "tiny-llama.toml"


def cli(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `python -m p2p_diloco ARGS` to the end."""
    return subprocess.run(
        [sys.executable, "-m", "p2p_diloco", *args], capture_output=True, text=True, timeout=timeout, cwd=cwd
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A solo tiny-Llama island, trained on JSONL with a BPE tokenizer trained here, and its checkpoints."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("lifecycle")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=384, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet, show_progress=False
    )
    tokenizer.train([str(p) for p in STDLIB], trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": p.read_text()}) + "\n" for p in STDLIB))
    config = json.loads((REPO / "peers" / "tiny-llama" / "config.json").read_text()) | {"vocab_size": 384}
    (folder / "llama.json").write_text(json.dumps(config))
    metrics, checkpoints = folder / "island.jsonl", folder / "ckpt"
    trained = cli(
        "peer", "--config", str(TINY_LLAMA), "--model-config", str(folder / "llama.json"),
        "--tokenizer", str(folder / "tokenizer.json"), "--data", str(folder / "docs.jsonl"),
        "--cache-dir", str(folder / "cache"), "--solo", "true", "--outer-steps", "3",
        "--metrics", str(metrics), "--checkpoint-dir", str(checkpoints), "--run-id", "lifecycle",
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    return {"folder": folder, "metrics": metrics, "checkpoints": checkpoints, "data": folder / "docs.jsonl"}


def test_an_exported_llama_loads_in_plain_transformers_with_the_islands_logits(run: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = run["folder"] / "export"
    exported = cli("export", "--checkpoint-dir", str(run["checkpoints"]), "--out", str(out))
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert "exported outer step 3 of run 'lifecycle' as hf" in exported.stdout
    loaded = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert tokenizer.eos_token == "<|endoftext|>" and len(tokenizer) == 384

    island_model, _, origin = checkpoint_model(str(run["checkpoints"]), None, None)
    assert origin["outer_step"] == 3
    checkpoint = load_checkpoint(latest_checkpoint(run["checkpoints"]))
    flat = torch.cat([p.detach().reshape(-1) for p in island_model.parameters()])
    assert torch.equal(flat, checkpoint["anchor"])  # the island's model holds exactly the anchor
    batch = torch.tensor([tokenizer("def main():\n    return 0\n")["input_ids"][:16]])
    with torch.no_grad():
        theirs = loaded(input_ids=batch).logits
        ours, _ = island_model.eval()(batch)
    assert theirs.shape == (1, batch.shape[1], 384)
    assert torch.allclose(theirs, ours, atol=1e-5), (theirs - ours).abs().max()


def test_eval_of_the_export_reports_the_loss_the_island_logged(run: dict[str, Path]) -> None:
    out = run["folder"] / "export-eval"
    assert cli("export", "--checkpoint-dir", str(run["checkpoints"]), "--out", str(out)).returncode == 0
    result = cli("eval", "--model", str(out), "--data", str(run["data"]), "--prompt", "import ", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout)
    logged = [json.loads(line) for line in run["metrics"].read_text().splitlines()][-1]
    assert logged["outer_step"] == 3
    assert abs(figures["eval_loss"] - logged["eval_loss"]) < 1e-4, (figures["eval_loss"], logged["eval_loss"])
    assert figures["perplexity"] == pytest.approx(2.718281828 ** figures["eval_loss"], rel=1e-6)
    assert figures["sample"].startswith("import ") and len(figures["sample"]) > len("import ")


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_the_other_formats_round_trip_through_eval(run: dict[str, Path], fmt: str) -> None:
    out = run["folder"] / f"export-{fmt}"
    assert (
        cli("export", "--checkpoint-dir", str(run["checkpoints"]), "--out", str(out), "--format", fmt).returncode == 0
    )
    assert (out / ("model.safetensors" if fmt == "safetensors" else "model.pt")).is_file()
    result = cli("eval", "--model", str(out), "--json")  # the run's own data and tokenizer, from p2p_diloco.json
    assert result.returncode == 0, result.stderr[-3000:]
    logged = [json.loads(line) for line in run["metrics"].read_text().splitlines()][-1]
    assert abs(json.loads(result.stdout)["eval_loss"] - logged["eval_loss"]) < 1e-4


def test_the_built_in_gpt_exports_as_safetensors_and_evaluates(tmp_path: Path) -> None:
    metrics = tmp_path / "gpt.jsonl"
    args = ["--config", "tiny", "--solo", "true", "--outer-steps", "2", "--inner-steps", "10"]
    trained = cli("peer", *args, "--metrics", str(metrics), "--checkpoint-dir", str(tmp_path / "ckpt"))
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert cli("export", "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "gpt")).returncode == 0
    result = cli("eval", "--model", str(tmp_path / "gpt"), "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    logged = [json.loads(line) for line in metrics.read_text().splitlines()][-1]
    assert abs(json.loads(result.stdout)["eval_loss"] - logged["eval_loss"]) < 1e-4
    hf = cli("export", "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "x"), "--format", "hf")
    assert hf.returncode == 2 and "--format hf needs a transformers model" in hf.stderr


def one_error_line(result: subprocess.CompletedProcess) -> str:
    """The single `error:` line of a failed command."""
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
    return errors[0]


def test_bad_input_is_a_one_line_error(run: dict[str, Path], tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in run["checkpoints"].iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    for path in broken.glob("*.pt"):
        path.write_bytes(b"not a checkpoint")
    line = one_error_line(cli("export", "--checkpoint-dir", str(broken), "--out", str(tmp_path / "out")))
    assert "every checkpoint in" in line and "is corrupt" in line

    out = run["folder"] / "export-tok"
    assert cli("export", "--checkpoint-dir", str(run["checkpoints"]), "--out", str(out)).returncode == 0
    other = tmp_path / "other.json"
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False)
    tokenizer.train([str(STDLIB[-1])], trainer)
    tokenizer.save(str(other))
    line = one_error_line(cli("eval", "--model", str(out), "--tokenizer", str(other), "--data", str(run["data"])))
    assert "is not the one this model was trained with" in line
    line = one_error_line(cli("eval", "--model", str(tmp_path)))
    assert "run p2p-diloco export first" in line


def test_pull_takes_the_swarms_anchor_without_training(local_swarm: LocalSwarm, tmp_path: Path) -> None:
    local_swarm.bootstrap()
    args = ["--outer-steps", "1000", "--num-shards", "2", "--quorum", "2", "--target-group-size", "2"]
    islands = [local_swarm.peer(f"llama-{i}", *args, "--shard-index", str(i), config=TINY_LLAMA) for i in range(2)]

    def both_merged() -> bool:
        return all(any(r["merged"] for r in island.records()) for island in islands)

    wait_until(both_merged, 240, "a round in which both islands merged")
    out = tmp_path / "pulled"
    swarm = [
        "--initial-peers",
        *local_swarm.maddrs,
        "--run-id",
        local_swarm.run_id,
        "--host-maddrs",
        "/ip4/127.0.0.1/tcp/0",
    ]
    pulled = cli("pull", "--config", str(TINY_LLAMA), *swarm, "--out", str(out))
    assert pulled.returncode == 0, pulled.stderr[-3000:]
    spec = json.loads((out / "p2p_diloco.json").read_text())
    step, digest = spec["origin"]["outer_step"], spec["origin"]["digest"]
    assert step >= 1, spec["origin"]
    anchors = {(r["outer_step"], r["anchor_digest"]) for island in islands for r in island.records()}
    assert (step, digest) in anchors, (step, digest, sorted(anchors)[-6:])  # the anchor an island holds at that step

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    state = load_checkpoint(latest_checkpoint(out / "checkpoint"))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(flat, state["anchor"])
    for island in islands:
        assert island.running, island.log_text()[-2000:]  # pulling disturbed no one
    assert all(r.get("peer_id") for island in islands for r in island.records())

    line = one_error_line(
        cli(
            "pull",
            "--config",
            str(TINY_LLAMA),
            *swarm[:-4],
            "--run-id",
            "nobody-trains-this",
            "--host-maddrs",
            "/ip4/127.0.0.1/tcp/0",
            "--out",
            str(tmp_path / "none"),
        )
    )
    assert "nobody trains run 'nobody-trains-this'" in line
    line = one_error_line(cli("pull", "--config", "tiny", *swarm, "--out", str(tmp_path / "wrong")))
    assert f"run '{local_swarm.run_id}' trains model" in line and "pass the run's peer config" in line
