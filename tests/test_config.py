"""The one configuration schema: flags, secrets, validation and round trips."""

import argparse

import pytest

from pdpool import config


def parse(argv, environ=None):
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    return config.from_args(parser.parse_args(argv), environ=environ or {})


def test_defaults_are_valid_and_flags_override():
    cfg = parse(["--max-num-seqs", "4", "--role", "prefill", "--block-size", "32"])
    assert cfg.scheduler.max_num_seqs == 4
    assert cfg.server.role == "prefill"
    assert cfg.cache.block_size == 32
    assert cfg.scheduler.max_num_batched_tokens == config.SchedulerConfig().max_num_batched_tokens


def test_every_setting_has_a_unique_flag():
    names = [f.name for _, f in config.all_options()]
    assert len(names) == len(set(names)), "a setting name is declared twice"
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    flags = {a for action in parser._actions for a in action.option_strings}
    for _, f in config.all_options():
        assert config.flag_name(f) in flags


@pytest.mark.parametrize("argv, message", [
    (["--max-num-seqs", "0"], "--max-num-seqs: 0 is below the minimum 1"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization: 1.5 is above the maximum 0.99"),
])
def test_out_of_range_is_a_clear_error(argv, message):
    with pytest.raises(config.ConfigError, match=message):
        parse(argv)


def test_bad_choice_is_rejected_by_the_parser():
    with pytest.raises(SystemExit):
        parse(["--role", "router"])


def test_secrets_come_from_env_or_file_not_only_argv(tmp_path):
    assert parse([], environ={"PDPOOL_API_KEY": "from-env"}).server.api_key == "from-env"
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    cfg = parse(["--api-key-file", str(key_file)], environ={"PDPOOL_API_KEY": "from-env"})
    assert cfg.server.api_key == "from-file"
    assert parse(["--redis-password-file", str(key_file)]).disagg.redis_password == "from-file"


def test_to_argv_round_trips_and_leaves_secrets_out():
    cfg = config.build(max_num_seqs=3, enable_prefix_caching=False, role="decode", api_key="s3cret",
                       kv_lease_seconds=2.5)
    argv = config.to_argv(cfg)
    assert "s3cret" not in argv
    again = parse(argv)
    assert again.scheduler.max_num_seqs == 3
    assert again.cache.enable_prefix_caching is False
    assert again.server.role == "decode"
    assert again.disagg.kv_lease_seconds == 2.5


def test_build_rejects_unknown_settings():
    with pytest.raises(config.ConfigError, match="unknown settings"):
        config.build(max_num_sequences=3)


def test_cors_flags_take_vllms_json_lists_or_repeated_values():
    cfg = parse([])
    assert (cfg.server.allowed_origins, cfg.server.allow_credentials, cfg.server.allowed_methods,
            cfg.server.allowed_headers) == (["*"], False, ["*"], ["*"])   # vLLM's defaults
    cfg = parse(["--allowed-origins", '["https://a.example", "https://b.example"]', "--allowed-origins",
                 "https://c.example", "--allow-credentials", "--allowed-methods", "[]", "--allowed-headers",
                 "X-Custom"])
    assert cfg.server.allowed_origins == ["https://a.example", "https://b.example", "https://c.example"]
    assert (cfg.server.allow_credentials, cfg.server.allowed_methods, cfg.server.allowed_headers) == (
        True, [], ["X-Custom"])
    assert parse(config.to_argv(cfg)) == cfg   # "[]" (nothing allowed) is not the default "*"
    with pytest.raises(SystemExit):
        parse(["--allowed-origins", '["https://a.example", 1]'])
    with pytest.raises(config.ConfigError, match="--allowed-origins: 'https://é.example' is not a header value"):
        parse(["--allowed-origins", "https://é.example"])
    router = config.build(config.RouterCommandConfig, allowed_headers=["Authorization"])
    assert router.router.allowed_headers == ["Authorization"] and router.router.allowed_origins == ["*"]
