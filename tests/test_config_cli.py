"""Configuration tree, CLI flags, multiaddr validation and the swarm list: no network, nothing is started."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from p2p_diloco.cli.flags import FLAG_ALIASES
from p2p_diloco.cli.flags import overrides as cli_overrides
from p2p_diloco.cli.known_swarms import SwarmListError, load_swarms, resolve_swarm, swarms_file
from p2p_diloco.cli.main import EXIT_BAD_INPUT, build_parser, main
from p2p_diloco.config import ConfigError, PeerConfig, load_config
from p2p_diloco.net.maddrs import MultiaddrError, validate_maddr, validate_maddrs

PEER_ID = "12D3KooWSY5iuuGuvHRpLGhuEZ3bCdWu75nYxJxcgpvrpuxJDRZV"
GOOD_MADDR = f"/ip4/127.0.0.1/tcp/1/p2p/{PEER_ID}"
TINY = Path(__file__).parents[1] / "peers" / "tiny.toml"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# --- load_config


def test_defaults():
    config = load_config()
    assert config == PeerConfig()
    assert config.model.d_model == 128 and config.model.n_heads == 4
    assert config.train.inner_steps == 50 and config.train.outer_lr == 0.7 and config.train.outer_momentum == 0.9
    assert config.network.run_id == "p2p-diloco"
    assert config.network.initial_peers == []
    assert config.network.host_maddrs == ["/ip4/0.0.0.0/tcp/0"]
    assert config.data.path is None and config.metrics is None
    # Mutable defaults are not shared between instances.
    config.network.initial_peers.append("x")
    assert load_config().network.initial_peers == []


def test_from_toml_file(tmp_path):
    path = write(
        tmp_path / "peer.toml",
        """
metrics = "m.jsonl"
[model]
d_model = 64
n_heads = 8
[train]
inner_steps = 7
lr = 1e-3
outer_lr = 1
[network]
run_id = "my-run"
initial_peers = ["a", "b"]
solo = true
""",
    )
    config = load_config(path)
    assert config.model.d_model == 64 and config.model.n_heads == 8
    assert config.model.n_layers == 2, "fields the file leaves out keep their defaults"
    assert config.train.inner_steps == 7
    assert config.train.lr == 1e-3
    assert config.train.outer_lr == 1.0 and isinstance(config.train.outer_lr, float)
    assert config.network.run_id == "my-run"
    assert config.network.initial_peers == ["a", "b"]
    assert config.network.solo is True
    assert config.metrics == "m.jsonl"
    assert load_config(str(path)) == config, "a str path works too"


def test_overrides_beat_the_file(tmp_path):
    path = write(tmp_path / "peer.toml", "[train]\ninner_steps = 7\nbatch_size = 4\n[network]\nrun_id = 'file-run'\n")
    config = load_config(path, {"train.inner_steps": "9", "network.run_id": "cli-run", "train.lr": None})
    assert config.train.inner_steps == 9
    assert config.train.batch_size == 4
    assert config.network.run_id == "cli-run"
    assert config.train.lr == 3e-3, "a None override leaves the value alone"


def test_override_coercion():
    config = load_config(
        overrides={
            "train.lr": "0.01",
            "network.initial_peers": "a,b,,c",
            "network.solo": "false",
            "data.shard_index": "1",
            "data.num_shards": 2,
            "checkpoint_every": "3",
        }
    )
    assert config.train.lr == 0.01
    assert config.network.initial_peers == ["a", "b", "c"]
    assert config.network.solo is False
    assert config.data.shard_index == 1 and config.data.num_shards == 2
    assert config.checkpoint_every == 3
    assert load_config(overrides={"network.solo": "true"}).network.solo is True


def test_bad_value_names_the_field():
    with pytest.raises(ConfigError, match="inner_steps.*'abc'"):
        load_config(overrides={"train.inner_steps": "abc"})


def test_unknown_field_in_file_names_the_field(tmp_path):
    path = write(tmp_path / "peer.toml", "[train]\ninner_stepz = 3\n")
    with pytest.raises(ConfigError, match=r"train\.inner_stepz") as info:
        load_config(path)
    assert "inner_steps" in str(info.value), "the message lists the known fields"


def test_unknown_section_in_file(tmp_path):
    with pytest.raises(ConfigError, match="bogus"):
        load_config(write(tmp_path / "peer.toml", "[bogus]\nx = 1\n"))


def test_section_that_is_not_a_table(tmp_path):
    with pytest.raises(ConfigError, match=r"\[train\] must be a table"):
        load_config(write(tmp_path / "peer.toml", "train = 3\n"))


def test_unknown_override_names_the_field():
    with pytest.raises(ConfigError, match=r"network\.nosuch"):
        load_config(overrides={"network.nosuch": "1"})


def test_bad_toml(tmp_path):
    path = write(tmp_path / "broken.toml", "[train\ninner_steps = \n")
    with pytest.raises(ConfigError, match="not valid TOML") as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_missing_file(tmp_path):
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="does not exist") as info:
        load_config(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        ({"model.d_model": 130, "model.n_heads": 4}, "divisible"),
        ({"network.request_timeout": 2.0, "network.min_matchmaking_time": 2.0}, "request_timeout"),
        ({"network.request_timeout": 3.0}, "request_timeout"),
        ({"network.leader_poll_s": -0.1}, "leader_poll_s"),
        ({"network.announce_every": 0}, "announce_every"),
        ({"network.dht_walk_every": 0}, "dht_walk_every"),
        ({"network.relay_port": 70000}, "relay_port"),
        ({"network.uplink_mbit": -1.0}, "uplink_mbit"),
        ({"network.uplink_mbit": float("nan")}, "uplink_mbit"),
        ({"network.expect_rounds": -1}, "expect_rounds"),
        ({"network.leader_poll_s": 1.0}, "leader_poll_s"),
        ({"network.run_id": "a.b"}, "run id"),
        ({"network.run_id": ""}, "run id"),
        ({"train.inner_steps": 0}, "inner_steps"),
        ({"train.outer_momentum": 1.0}, "outer_momentum"),
        ({"network.quorum": 4, "network.target_group_size": 2}, "quorum"),
        ({"data.num_shards": 2, "data.shard_index": 2}, "shard_index"),
    ],
)
def test_validation_errors(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(overrides=overrides)


def test_validation_applies_to_files_too(tmp_path):
    with pytest.raises(ConfigError, match="divisible"):
        load_config(write(tmp_path / "peer.toml", "[model]\nd_model = 30\nn_heads = 4\n"))


def test_tiny_toml_loads():
    config = load_config(TINY)
    assert config.model.d_model == 32 and config.model.n_heads == 2 and config.model.n_layers == 1
    assert config.train.inner_steps == 10 and config.train.outer_steps == 5
    assert config.network.request_timeout < config.network.min_matchmaking_time
    assert dataclasses.asdict(config)["model"]["seq_len"] == 32


# --- CLI


def leaf_fields(cls: type = PeerConfig, prefix: str = "") -> list[tuple[str, dataclasses.Field]]:
    """(dotted name, field) of every leaf field, found by recursing into nested config dataclasses."""
    instance = cls()
    leaves = []
    for field in dataclasses.fields(cls):
        value = getattr(instance, field.name)
        if dataclasses.is_dataclass(value):
            leaves.extend(leaf_fields(type(value), f"{prefix}{field.name}."))
        else:
            leaves.append((f"{prefix}{field.name}", field))
    return leaves


def test_leaf_fields_cover_every_section():
    names = {dotted for dotted, _ in leaf_fields()}
    assert {"model.d_model", "data.path", "train.inner_steps", "network.run_id", "metrics"} <= names
    assert len(names) > 30


@pytest.mark.parametrize(("dotted", "field"), leaf_fields(), ids=[dotted for dotted, _ in leaf_fields()])
def test_every_config_field_has_a_peer_flag(dotted, field):
    flag = "--" + FLAG_ALIASES.get(dotted, dotted.split(".")[-1]).replace("_", "-")
    value = "true" if dotted == "network.solo" else "1"
    args = build_parser().parse_args(["peer", flag, value])
    expected = [value] if str(field.type).startswith("list") else value
    assert getattr(args, dotted) == expected, f"{flag} must set {dotted}"
    # Nothing else is set by that one flag.
    assert cli_overrides(args) == {dotted: expected}


def test_named_flags_exist():
    flags = [
        "--initial-peers",
        "--run-id",
        "--config",
        "--inner-steps",
        "--outer-steps",
        "--batch-size",
        "--lr",
        "--outer-lr",
        "--outer-momentum",
        "--seed",
        "--data",
        "--metrics",
        "--checkpoint-dir",
    ]
    parser = build_parser()
    for flag in flags:
        values = list(vars(parser.parse_args(["peer", flag, "v"])).values())
        assert "v" in values or ["v"] in values, flag


def test_peer_flags_become_typed_overrides():
    args = build_parser().parse_args(["peer", "--inner-steps", "7", "--initial-peers", "A", "B", "--lr", "0.5"])
    overrides = cli_overrides(args)
    assert overrides == {"train.inner_steps": "7", "network.initial_peers": ["A", "B"], "train.lr": "0.5"}
    config = load_config(args.config, overrides)
    assert config.train.inner_steps == 7 and isinstance(config.train.inner_steps, int)
    assert config.network.initial_peers == ["A", "B"]
    assert config.train.lr == 0.5


def test_peer_flags_beat_the_config_file():
    args = build_parser().parse_args(["peer", "--config", str(TINY), "--inner-steps", "3", "--data", "corpus.txt"])
    config = load_config(args.config, cli_overrides(args))
    assert config.train.inner_steps == 3
    assert config.train.outer_steps == 5, "from tiny.toml"
    assert config.data.path == "corpus.txt"


def test_a_subcommand_is_required(capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args([])
    assert info.value.code == 2


def one_error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_peer_with_out_of_range_port_exits_2(capsys):
    bad = f"/ip4/127.0.0.1/tcp/99999/p2p/{PEER_ID}"
    assert main(["peer", "--initial-peers", bad, "--run-id", "x"]) == EXIT_BAD_INPUT
    line = one_error_line(capsys)
    assert bad in line and "error" in line


def test_peer_with_garbage_address_exits_2(capsys):
    assert main(["peer", "--initial-peers", "garbage", "--run-id", "x"]) == EXIT_BAD_INPUT
    assert "'garbage'" in one_error_line(capsys)


def test_peer_address_without_peer_id_exits_2(capsys):
    bad = "/ip4/127.0.0.1/tcp/1234"
    assert main(["peer", "--initial-peers", bad, "--run-id", "x"]) == EXIT_BAD_INPUT
    line = one_error_line(capsys)
    assert bad in line and "peer id" in line


def test_peer_names_the_bad_address_among_good_ones(capsys):
    assert main(["peer", "--initial-peers", GOOD_MADDR, "nonsense", "--run-id", "x"]) == EXIT_BAD_INPUT
    line = one_error_line(capsys)
    assert "'nonsense'" in line and GOOD_MADDR not in line


def test_peer_with_bad_config_value_exits_2(capsys):
    assert main(["peer", "--initial-peers", GOOD_MADDR, "--run-id", "a.b"]) == EXIT_BAD_INPUT
    assert "'a.b'" in one_error_line(capsys)


def test_bootstrap_with_bad_host_maddr_exits_2(capsys):
    assert main(["bootstrap", "--host-maddrs", "nonsense"]) == EXIT_BAD_INPUT
    line = one_error_line(capsys)
    assert "'nonsense'" in line and line.startswith("p2p-diloco bootstrap: error:")


def test_bootstrap_with_initial_peer_without_peer_id_exits_2(capsys):
    assert main(["bootstrap", "--initial-peers", "/ip4/127.0.0.1/tcp/5"]) == EXIT_BAD_INPUT
    assert "peer id" in one_error_line(capsys)


# --- multiaddrs


@pytest.mark.parametrize(
    "text",
    [f"/ip4/127.0.0.1/tcp/1234/p2p/{PEER_ID}", f"/dns4/example.com/tcp/1/p2p/{PEER_ID}"],
)
def test_validate_maddr_accepts_good_addresses(text):
    assert validate_maddr(text, need_peer_id=True) == text


def test_validate_maddr_without_peer_id_when_not_needed():
    assert validate_maddr("/ip4/0.0.0.0/tcp/0", need_peer_id=False) == "/ip4/0.0.0.0/tcp/0"
    with pytest.raises(MultiaddrError, match="peer id"):
        validate_maddr("/ip4/0.0.0.0/tcp/0", need_peer_id=True)


def test_validate_maddr_needs_a_transport():
    with pytest.raises(MultiaddrError, match="tcp"):
        validate_maddr("/ip4/127.0.0.1", need_peer_id=False)


def test_validate_maddrs_raises_on_the_first_bad_one():
    assert validate_maddrs([GOOD_MADDR, GOOD_MADDR], need_peer_id=True) == [GOOD_MADDR, GOOD_MADDR]
    with pytest.raises(MultiaddrError, match="'/ip4/300.0.0.1/tcp/1'"):
        validate_maddrs([GOOD_MADDR, "/ip4/300.0.0.1/tcp/1"], need_peer_id=False)


# --- swarm list

SWARMS_TOML = f"""
[swarms.demo]
run_id = "demo-run"
initial_peers = ["{GOOD_MADDR}"]

[swarms.other]
initial_peers = ["{GOOD_MADDR}"]

[swarms.empty]
run_id = "nobody"
"""


def overrides_of(name: str, path: Path | None = None) -> dict:
    """The config overrides of resolve_swarm."""
    overrides, _ = resolve_swarm(name, path)
    return overrides


@pytest.fixture
def swarms_path(tmp_path) -> Path:
    return write(tmp_path / "swarms.toml", SWARMS_TOML)


def test_resolve_swarm(swarms_path):
    overrides = overrides_of("demo", swarms_path)
    assert overrides == {"network.run_id": "demo-run", "network.initial_peers": [GOOD_MADDR]}
    config = load_config(overrides=overrides)
    assert config.network.run_id == "demo-run" and config.network.initial_peers == [GOOD_MADDR]


def test_resolve_swarm_run_id_defaults_to_the_name(swarms_path):
    assert overrides_of("other", swarms_path)["network.run_id"] == "other"


def test_unknown_swarm_lists_the_known_names(swarms_path):
    with pytest.raises(SwarmListError, match="'nope'") as info:
        resolve_swarm("nope", swarms_path)
    assert "demo, empty, other" in str(info.value)


def test_swarm_without_peers(swarms_path):
    with pytest.raises(SwarmListError, match="no initial_peers"):
        resolve_swarm("empty", swarms_path)


def test_missing_and_malformed_swarm_lists(tmp_path):
    with pytest.raises(SwarmListError, match="not found"):
        load_swarms(tmp_path / "missing.toml")
    with pytest.raises(SwarmListError, match="not valid TOML"):
        load_swarms(write(tmp_path / "bad.toml", "[swarms.demo\n"))
    assert load_swarms(write(tmp_path / "none.toml", "")) == {}


def test_env_var_selects_the_swarm_list(swarms_path, monkeypatch):
    monkeypatch.setenv("P2P_DILOCO_SWARMS", str(swarms_path))
    assert swarms_file() == swarms_path
    assert overrides_of("demo")["network.run_id"] == "demo-run"


def test_local_swarm_list_without_env_var(tmp_path, monkeypatch):
    monkeypatch.delenv("P2P_DILOCO_SWARMS", raising=False)
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "bootstrap" / "swarms.toml", SWARMS_TOML)
    assert swarms_file() == Path("bootstrap/swarms.toml")
    assert overrides_of("other")["network.run_id"] == "other"


def test_peer_with_unknown_swarm_exits_2(swarms_path, monkeypatch, capsys):
    monkeypatch.setenv("P2P_DILOCO_SWARMS", str(swarms_path))
    assert main(["peer", "--swarm", "nope"]) == EXIT_BAD_INPUT
    line = one_error_line(capsys)
    assert "'nope'" in line and "demo" in line


def test_a_swarm_entry_resolves_paths_against_its_list_and_carries_network_options(tmp_path, monkeypatch):
    folder = tmp_path / "registry"
    write(folder / "configs" / "small.toml", "[train]\ninner_steps = 7\n")
    path = write(
        folder / "swarms.toml",
        f"""
[swarms.small]
run_id = "small-run"
config = "configs/small.toml"
initial_peers = ["{GOOD_MADDR}"]
[swarms.small.network]
relay = "only"
client_mode = "on"
""",
    )
    monkeypatch.chdir(tmp_path)  # the entry's path must not depend on where the user stands
    overrides, config_path = resolve_swarm("small", path)
    assert Path(config_path) == (folder / "configs" / "small.toml").resolve()
    config = load_config(config_path, overrides)
    assert config.train.inner_steps == 7 and config.network.relay == "only" and config.network.client_mode == "on"
    assert swarms_file(str(path)) == path  # --swarms-file wins over the environment and ./bootstrap/


def test_a_swarm_entry_with_a_bad_path_or_option_is_one_line(tmp_path, capsys):
    path = write(
        tmp_path / "swarms.toml",
        f"""
[swarms.broken]
config = "nowhere/peer.toml"
initial_peers = ["{GOOD_MADDR}"]
[swarms.typo]
initial_peers = ["{GOOD_MADDR}"]
[swarms.typo.network]
relays = "auto"
[swarms.extra]
initial_peers = ["{GOOD_MADDR}"]
confg = "x.toml"
""",
    )
    assert main(["peer", "--swarm", "broken", "--swarms-file", str(path)]) == EXIT_BAD_INPUT
    line = one_error_line(capsys)
    assert "config nowhere/peer.toml does not exist" in line and "relative to the swarm list's folder" in line
    with pytest.raises(SwarmListError, match=r"\[network\] options must be among"):
        resolve_swarm("typo", path)
    with pytest.raises(SwarmListError, match=r"unknown keys \['confg'\]"):
        resolve_swarm("extra", path)


def test_swarms_command_lists_the_registry(tmp_path, capsys, swarms_path):
    assert main(["swarms", "--swarms-file", str(swarms_path)]) == 0
    out = capsys.readouterr().out
    assert "demo: run demo-run, 1 initial peers" in out and "other: run other" in out


def test_status_without_a_target_is_one_line(capsys):
    assert main(["status"]) == EXIT_BAD_INPUT
    assert "pass --initial-peers MADDR" in one_error_line(capsys)
    assert main(["status", "--initial-peers", GOOD_MADDR]) == EXIT_BAD_INPUT
    assert "pass --run-id RUN" in one_error_line(capsys)


def test_new_network_choices_are_checked():
    with pytest.raises(ConfigError, match="network.relay must be one of auto, off, only; got 'sometimes'"):
        load_config(overrides={"network.relay": "sometimes"})
    with pytest.raises(ConfigError, match="network.client_mode must be one of auto, on, off"):
        load_config(overrides={"network.client_mode": "yes"})


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--lr", "nan"], "must be a finite number"),
        (["--outer-lr", "-1"], "train.outer_lr=-1.0 must be a positive learning rate"),
        (["--batch-size", "8.7"], "must be a whole number"),
        (["--dynamic-steps", "maybe"], "must be true or false"),
        (["--relay", "sometimes"], "network.relay must be one of"),
        (["--membership", "nowhere.token"], "--membership nowhere.token does not exist"),
        (["--codec", "topk", "--topk-density", "1.5"], "network.topk_density=1.5 must be in (0, 1]"),
        (["--codec", "topk", "--topk-density", "0"], "network.topk_density=0.0 must be in (0, 1]"),
        (["--codec", "topk", "--topk-bits", "3"], "network.topk_bits=3 must be 2 or 4"),
    ],
)
def test_bad_values_are_one_line_errors(argv, expected, capsys):
    assert main(["peer", "--solo", "true", *argv]) == EXIT_BAD_INPUT
    assert expected in one_error_line(capsys)


def test_bad_paths_are_one_line_errors(tmp_path, capsys):
    (tmp_path / "a-file").write_text("x")
    assert main(["peer", "--solo", "true", "--metrics", str(tmp_path)]) == EXIT_BAD_INPUT
    assert "is a folder" in one_error_line(capsys)
    assert main(["peer", "--solo", "true", "--checkpoint-dir", str(tmp_path / "a-file")]) == EXIT_BAD_INPUT
    assert "is a file" in one_error_line(capsys)
    write(tmp_path / "config.toml", "[train]\nbatch_size = 8.7\n")
    assert main(["peer", "--solo", "true", "--config", str(tmp_path / "config.toml")]) == EXIT_BAD_INPUT
    assert "'batch_size'" in one_error_line(capsys)


def test_binary_data_is_refused(tmp_path, capsys):
    (tmp_path / "blob.txt").write_bytes(bytes(range(256)) * 100)
    assert main(["peer", "--solo", "true", "--data", str(tmp_path / "blob.txt"), "--outer-steps", "1"]) == 2
    assert "looks binary" in one_error_line(capsys)
    (tmp_path / "blob.bin").write_bytes(bytes(range(256)) * 100)
    assert main(["peer", "--solo", "true", "--data", str(tmp_path / "blob.bin"), "--outer-steps", "1"]) == 2
    assert "holds no .txt" in one_error_line(capsys)


def test_an_island_refuses_to_start_over_corrupt_checkpoints(tmp_path, capsys):
    folder = tmp_path / "ckpt"
    args = ["peer", "--solo", "true", "--config", str(TINY), "--outer-steps", "2", "--checkpoint-dir", str(folder)]
    assert main(args) == 0
    saved = sorted(folder.glob("ckpt-*.pt"))
    for path in saved:
        path.write_bytes(b"garbage")
    assert main([*args, "--outer-steps", "3"]) == EXIT_BAD_INPUT
    line = one_error_line(capsys)
    assert "every checkpoint" in line and "--fresh" in line and saved[-1].name in line
    assert sorted(folder.glob("ckpt-*.pt")) == saved  # nothing was deleted
    assert main([*args, "--outer-steps", "3", "--fresh", "true"]) == 0
