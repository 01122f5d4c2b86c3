"""The servers a run starts itself, spawned or as Ray engine replicas, get the run's key/value cache flags,
and `tokenmill serve` reads them back as the config's values."""

from __future__ import annotations

from tokenmill.cli import build_parser
from tokenmill.config.load import load_config
from tokenmill.config.schema import RLConfig
from tokenmill.controller.placement import kv_cache_args


def test_the_kv_cache_flags_reach_tokenmill_serve_as_configured():
    cfg = load_config(RLConfig, {"model": {"path": "m"}, "data": {"task": "addition"},
                                 "engine": {"kv_cache": "paged", "kv_block_size": 32}})
    args = build_parser().parse_args(["serve", "model", *kv_cache_args(cfg)])
    assert (args.kv_cache, args.kv_block_size) == ("paged", 32)
    default = load_config(RLConfig, {"model": {"path": "m"}, "data": {"task": "addition"}})
    assert kv_cache_args(default) == ("--kv-cache", "static", "--kv-block-size", "16")

