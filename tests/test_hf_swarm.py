"""A swarm of transformers models: two tiny-Llama islands merge; an island of another Llama config is refused."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import REPO, LocalSwarm, wait_until

TINY_LLAMA = REPO / "peers" / "tiny-llama.toml"


def test_tiny_llama_islands_merge_into_one_model_and_another_config_is_refused(
    local_swarm: LocalSwarm, tmp_path: Path
) -> None:
    local_swarm.bootstrap()
    args = ["--outer-steps", "6", "--num-shards", "2", "--quorum", "2", "--target-group-size", "2"]
    islands = [local_swarm.peer(f"llama-{i}", *args, "--shard-index", str(i), config=TINY_LLAMA) for i in range(2)]
    wait_until(lambda: all(island.records() for island in islands), 240, "both islands' first round")

    wider = json.loads((REPO / "peers" / "tiny-llama" / "config.json").read_text()) | {"intermediate_size": 96}
    (tmp_path / "wider.json").write_text(json.dumps(wider))
    wider_args = ["--outer-steps", "6", "--model-config", str(tmp_path / "wider.json")]
    odd = local_swarm.peer("odd", *wider_args, config=TINY_LLAMA)
    assert odd.wait(180) == 2, odd.log_text()[-2000:]
    errors = [line for line in odd.log_text().splitlines() if "error:" in line]
    assert len(errors) == 1 and "model mismatch" in errors[0], odd.log_text()[-2000:]

    for island in islands:
        assert island.wait(300) == 0, island.log_text()[-3000:]
    records = [island.records() for island in islands]
    for island in records:
        assert island[-1]["eval_loss"] < island[0]["eval_loss"] - 0.3, [r["eval_loss"] for r in island]
        assert island[-1]["gpu_mem_gb"] is None  # CPU islands report no GPU memory
    same_step = [(a, b) for a in records[0] for b in records[1] if a["outer_step"] == b["outer_step"]]
    merged_together = [(a, b) for a, b in same_step if a["merged"] and b["merged"]]
    assert len(merged_together) >= 3, [(r["outer_step"], r["merged"]) for r in records[0]]
    for a, b in merged_together:
        assert a["anchor_digest"] == b["anchor_digest"], (a["outer_step"], a["note"], b["note"])
