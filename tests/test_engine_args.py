"""``EngineArgs``: vLLM's flag spellings, today's aliases, how the shorthand flags combine with
``--speculative-config``, the ``-k`` range message, one ``--seed`` meaning, and the one
``EngineConfig`` that ``LLM`` builds from its keyword arguments."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from test_engine_fixtures import make_model

from mtpspec import LLM, SamplingParams
from mtpspec.config import ParallelConfig, SpeculativeConfig
from mtpspec.engine.arg_utils import EngineArgs
from mtpspec.engine.config import CacheConfig
from mtpspec.entrypoints import bench_arms, generate, tp_demo
from mtpspec.entrypoints.serve import check_serve_args, engine_info, llm_kwargs

JSON3 = '{"method": "mtp", "num_speculative_tokens": 3, "use_local_argmax_reduction": true}'


def _engine(argv):
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    return EngineArgs.from_cli_args(p.parse_args(argv))


def _spec(argv):
    return _engine(argv).resolved_speculative_config()


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("tiny_args"))
    make_model(p, seed=21)
    return p


# ------------------------------------------------------------------------ spellings and defaults
def test_defaults() -> None:
    e = _engine([])
    assert _spec([]) == SpeculativeConfig("mtp", 3, True)
    assert (e.tensor_parallel_size, e.seed, e.allreduce_backend, e.fuse_allreduce_rmsnorm, e.sequence_parallel,
            e.max_num_seqs, e.max_model_len, e.num_kv_blocks, e.enforce_eager) == (1, 0, "nccl", True, False, 64,
                                                                                   None, None, False)
    assert EngineArgs().resolved_speculative_config() is None  # Python default: like LLM(), no speculation


@pytest.mark.parametrize("argv", [["--tensor-parallel-size", "2"], ["-tp", "2"], ["--tp", "2"]])
def test_tensor_parallel_aliases(argv) -> None:
    assert _engine(argv).tensor_parallel_size == 2
    assert _engine(argv).parallel_config() == ParallelConfig(2, False, True, "nccl")


@pytest.mark.parametrize("argv", [["--speculative-config", JSON3], ["-k", "3"], ["--num-speculative-tokens", "3"],
                                  ["--speculative-config", JSON3, "-k", "3"],
                                  ["--speculative-config", '{"use_local_argmax_reduction": true}', "-k", "3"]])
def test_speculative_spellings_agree(argv) -> None:
    assert _spec(argv) == SpeculativeConfig("mtp", 3, True)


def test_shorthand_fills_in_and_json_keeps_vllm_defaults() -> None:
    assert _spec(["--speculative-config", '{"num_speculative_tokens": 2}']) == SpeculativeConfig("mtp", 2, False)
    assert _spec(["--speculative-config", "{}"]) == SpeculativeConfig("mtp", 1, False)
    assert _spec(["--speculative-config", "{}", "-k", "4"]) == SpeculativeConfig("mtp", 4, False)
    assert _spec(["--speculative-config", '{"num_speculative_tokens": 2}', "--no-local-argmax"]) == \
        SpeculativeConfig("mtp", 2, False)
    assert _spec(["-k", "2", "--no-local-argmax"]) == SpeculativeConfig("mtp", 2, False)
    assert _spec(["-k", "0"]) is None and _spec(["--speculative-config", "null"]) is None


@pytest.mark.parametrize("argv,match", [
    (["--speculative-config", JSON3, "-k", "2"],
     r"-k/--num-speculative-tokens 2 conflicts with --speculative-config num_speculative_tokens=3"),
    (["--speculative-config", JSON3, "-k", "0"], r"-k/--num-speculative-tokens 0 \(no speculation\) conflicts"),
    (["--speculative-config", JSON3, "--no-local-argmax"],
     "--no-local-argmax conflicts with --speculative-config use_local_argmax_reduction=true"),
    (["--speculative-config", '{"k": 3}'], r"unknown speculative_config keys: \['k'\]; expected some of"),
    (["--speculative-config", '{"method": "eagle"}'], "method must be 'mtp' .*got 'eagle'"),
    (["--speculative-config", '{"num_speculative_tokens": 0}'], r"num_speculative_tokens must be an int in \[1, 16\], got 0"),
    (["--speculative-config", '{"num_speculative_tokens": "3"}'], r"num_speculative_tokens must be an int in \[1, 16\], got '3'"),
    (["--speculative-config", '{"use_local_argmax_reduction": 1}'], "use_local_argmax_reduction must be true or false, got 1"),
    (["--speculative-config", "{method: mtp}"], "--speculative-config: invalid JSON"),
    (["--speculative-config", "[3]"], "--speculative-config must be a JSON object, got \\[3\\]"),
])
def test_speculative_errors_name_the_key(argv, match) -> None:
    with pytest.raises(ValueError, match=match):
        _spec(argv)


def test_vllm_model_key_null_or_the_target(path, tmp_path) -> None:
    """vLLM's ``model`` key: null or the target (its path, or another spelling of the same folder) is
    taken and dropped; another model is refused, naming both (MTP drafts with the target's layers)."""
    base = ["--model", path, "--speculative-config"]
    for model in ("null", json.dumps(path), json.dumps(path + "/")):
        assert _spec(base + ['{"method": "mtp", "model": %s, "num_speculative_tokens": 2}' % model]) == \
            SpeculativeConfig("mtp", 2, False)
    other = str(tmp_path)
    for model in (json.dumps(other), "3"):
        with pytest.raises(ValueError, match=r"speculative_config: model must be null or the target model \("):
            _spec(base + ['{"model": %s, "num_speculative_tokens": 2}' % model])


@pytest.mark.parametrize("k", ["17", "-1", "99"])
def test_k_range_message_includes_zero(k) -> None:
    with pytest.raises(ValueError, match=r"^-k/--num-speculative-tokens \(num_speculative_tokens\) must be an int in "
                                         r"\[0, 16\] \(0 = no speculation\), got " + k + "$"):
        _spec(["-k", k])


def test_generate_k_error_states_the_range(path, capsys) -> None:
    p = argparse.ArgumentParser()
    generate.add_parser(p.add_subparsers(dest="command"))
    assert generate.run(p.parse_args(["generate", "--model", path, "-k", "17"])) == 2
    assert "-k/--num-speculative-tokens (num_speculative_tokens) must be an int in [0, 16] (0 = no speculation)" \
        in capsys.readouterr().err


# ------------------------------------------------------------------------ commands
def test_serve_flags_checked_and_info(path) -> None:
    check_serve_args(["-tp", "2", "--allreduce-backend", "p2p", "--served-model-name", "x", "--num-gpu-blocks-override", "8"])
    check_serve_args(["--log-level", "INFO", "--torch-threads", "2"])
    check_serve_args(["--uvicorn-log-level", "debug"])  # vLLM's spelling
    for argv, match in ((["--allreduce-backend", "mpi"], "invalid choice: 'mpi'"), (["--bogus"], "unrecognized"),
                        (["-k", "2", "--speculative-config", JSON3], "conflicts"),
                        # checked before the model loads (a new-user pass: tracebacks after it had)
                        (["--log-level", "LOUD"], "invalid choice: 'loud'"), (["--torch-threads", "-3"], ">= 1"),
                        (["--torch-threads", "0"], ">= 1"), (["--max-queue-len", "0"], ">= 1"),
                        (["--first-output-handoff-ms", "nan"], "finite number >= 0"),
                        # the model's split too (bench arms started a server to learn it, a new-user pass)
                        (["-tp", "3"], "num_attention_heads=8 is not divisible by tensor_parallel_size=3")):
        with pytest.raises(ValueError, match=match):
            check_serve_args(argv)
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    args = p.parse_args(["--model", path, "--speculative-config", JSON3, "--no-fusion", "--seed", "7",
                         "--num-gpu-blocks-override", "9"])
    kw = llm_kwargs(args)
    assert kw["speculative_config"] == json.loads(JSON3) and kw["num_kv_blocks"] == 9 and kw["seed"] == 7
    info = engine_info(args, kw, None)
    assert (info["tp"], info["num_speculative_tokens"], info["fusion"], info["local_argmax"], info["allreduce_backend"],
            info["seed"]) == (1, 3, False, True, "nccl", 7)
    assert (info["enable_chunked_prefill"], info["max_num_batched_tokens"], info["long_prefill_token_threshold"]) == \
        (True, "derived", 0)


def test_serve_bad_or_busy_port_exits_2_before_loading(capsys) -> None:
    """``--port`` outside [0, 65535] is an argparse error; a port another process listens on is
    ``error: cannot listen on HOST:PORT: ...`` before the model (here: none) is looked at."""
    import socket
    from mtpspec.entrypoints.cli import main
    for port in ("99999", "-1", "http"):
        with pytest.raises(SystemExit) as info:
            main(["serve", "--port", port])
        assert info.value.code == 2
        assert "--port: must be an int in [0, 65535]" in capsys.readouterr().err
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert main(["serve", "--model", "/no/such/model", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"error: cannot listen on 127.0.0.1:{port}: " in err and "no model" not in err, err


def test_serve_holds_its_port_while_the_model_loads(capsys, monkeypatch) -> None:
    """The port is bound before the model loads and held through the load (a -tp 2 server's ranks pick
    free ports meanwhile: a CPU test run failed with "address already in use" when one of them took the
    port checked and released before); a failed load releases it."""
    import socket
    from mtpspec.entrypoints import serve
    from mtpspec.entrypoints.cli import main
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    seen = []

    def build(args):  # the load: is the port taken now?
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
            try:
                other.bind(("127.0.0.1", port))
                seen.append("free")
            except OSError:
                seen.append("held")
        raise ValueError("no model here")

    monkeypatch.setattr(serve, "build", build)
    assert main(["serve", "--port", str(port)]) == 2
    assert seen == ["held"] and "error: no model here" in capsys.readouterr().err
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as again:  # released after the failed load (a plain
        again.bind(("127.0.0.1", port))  # bind: with SO_REUSEADDR it would pass beside a socket left bound)


def test_chunked_prefill_flags(path) -> None:
    """vLLM's spellings: on by default, ``--no-enable-chunked-prefill`` keeps whole-prompt prefills
    (and then the budget must hold ``max_model_len``), ``--long-prefill-token-threshold`` caps a
    prompt's chunk; both reach the scheduler config and ``LLM(...)``'s keyword arguments."""
    assert (_engine([]).enable_chunked_prefill, _engine([]).long_prefill_token_threshold) == (True, 0)
    off = _engine(["--model", path, "--no-enable-chunked-prefill", "--max-model-len", "64"])
    assert off.llm_kwargs()["enable_chunked_prefill"] is False
    sched = off.create_engine_config().scheduler_config
    assert (sched.enable_chunked_prefill, sched.max_num_batched_tokens) == (False, 256)  # max(64, 64 * (1 + 3))
    on = _engine(["--model", path, "--enable-chunked-prefill", "--long-prefill-token-threshold", "32",
                  "--max-num-batched-tokens", "256", "--max-model-len", "200"])
    assert on.llm_kwargs()["long_prefill_token_threshold"] == 32
    sched = on.create_engine_config().scheduler_config
    assert (sched.enable_chunked_prefill, sched.long_prefill_token_threshold, sched.max_num_batched_tokens) == \
        (True, 32, 256)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=100 is too small: with chunked prefill off"):
        _engine(["--model", path, "--no-enable-chunked-prefill", "--max-num-batched-tokens", "100",
                 "--max-model-len", "200", "--max-num-seqs", "8"]).create_engine_config()
    assert _engine(["--model", path, "--max-num-batched-tokens", "100", "--max-model-len", "200", "--max-num-seqs",
                    "8"]).create_engine_config().scheduler_config.max_num_batched_tokens == 100
    with pytest.raises(ValueError, match="long_prefill_token_threshold=32 caps prefill chunks"):
        _engine(["--model", path, "--no-enable-chunked-prefill", "--long-prefill-token-threshold", "32"]
                ).create_engine_config()
    check_serve_args(["--no-enable-chunked-prefill"])


def test_bench_arms_checks_server_args_before_any_server(monkeypatch, tmp_path, capsys) -> None:
    started = []
    monkeypatch.setattr(bench_arms, "ArmServer", lambda *a, **k: started.append(a) or 1 / 0)
    p = argparse.ArgumentParser()
    bench_arms.add_parser(p.add_subparsers(dest="command"))
    for server_args, match in (("--tp 2 --bogus", "unrecognized arguments: --bogus"),
                               (f"--speculative-config '{JSON3}'", "--no-local-argmax conflicts"),
                               ("--max-model-len 64", "tokens exceed arm 'baseline''s max_model_len=64")):
        args = p.parse_args(["arms", "--server-args", server_args, "--random-prompts", "--output-dir", str(tmp_path)])
        assert bench_arms.run(args) == 2
        assert match in capsys.readouterr().err and not started


def test_tp_demo_aliases() -> None:
    p = argparse.ArgumentParser()
    tp_demo.add_parser(p.add_subparsers(dest="command"))
    for flag in ("--tensor-parallel-size", "-tp", "--tp"):
        args = p.parse_args(["tp-demo", flag, "3"])
        assert args.tp == 3 and args.allreduce_backend == "nccl"


# ------------------------------------------------------------------------ one config, one seed
def test_llm_builds_one_engine_config_from_its_kwargs(path) -> None:
    with LLM(path, speculative_config={"num_speculative_tokens": 2}, fuse_allreduce_rmsnorm=False,
             max_model_len=48, block_size=4, num_kv_blocks=64, max_num_seqs=3, seed=11, enforce_eager=True) as llm:
        cfg = llm.engine_config
        assert cfg.parallel_config == ParallelConfig(1, False, False, "nccl") == llm.parallel_config
        # resolved against the model: GLM-4.5 has no indexer, so index sharing is off
        assert cfg.speculative_config == SpeculativeConfig("mtp", 2, False, False)
        assert (cfg.scheduler_config.max_num_seqs, cfg.scheduler_config.max_model_len,
                cfg.scheduler_config.num_speculative_tokens) == (3, 48, 2)
        assert (cfg.cache_config.block_size, cfg.cache_config.num_kv_blocks) == (4, 64)
        assert (cfg.graph_mode, cfg.seed, cfg.model, cfg.model_config.vocab_size) == ("off", 11, path, llm.model_config.vocab_size)
    e = EngineArgs(model=path, speculative_config={"num_speculative_tokens": 2}, fuse_allreduce_rmsnorm=False,
                   max_model_len=48, block_size=4, num_kv_blocks=64, max_num_seqs=3, seed=11, enforce_eager=True)
    assert e.create_engine_config() == cfg


def test_seed_is_the_engine_seed_and_sampling_seed_is_per_request(path, capsys) -> None:
    p = argparse.ArgumentParser()
    generate.add_parser(p.add_subparsers(dest="command"))
    base = ["generate", "--model", path, "--prompt", "w5 w6", "--prompt", "w9", "-k", "2", "--max-tokens", "8",
            "--max-model-len", "48", "--num-kv-blocks", "64", "--temperature", "1.0", "--json"]
    kw = dict(max_model_len=48, num_kv_blocks=64, speculative_config={"num_speculative_tokens": 2,
                                                                      "use_local_argmax_reduction": True},
              max_num_seqs=64)
    sp = SamplingParams(temperature=1.0, max_tokens=8)

    def cli(*extra):
        assert generate.run(p.parse_args(base + list(extra))) == 0
        return [o["token_ids"] for o in json.loads(capsys.readouterr().out)["outputs"]]

    with LLM(path, seed=5, **kw) as llm:
        engine_seeded = [o.outputs[0].token_ids for o in llm.generate(["w5 w6", "w9"], sp, use_tqdm=False)]
    with LLM(path, seed=0, **kw) as llm:
        per_request = [o.outputs[0].token_ids for o in llm.generate(
            ["w5 w6", "w9"], SamplingParams(temperature=1.0, max_tokens=8, seed=123), use_tqdm=False)]
    default = cli()
    assert cli("--seed", "5") == engine_seeded != default  # the seed matters, and --seed is the engine's
    assert cli("--sampling-seed", "123") == per_request != default


def test_index_share_needs_an_indexer(path) -> None:
    # index_share_for_mtp_iteration: JSON spelling checked; on a model without an indexer it
    # resolves to off when unset and is a start-up error when requested.
    from mtpspec.engine.arg_utils import parse_speculative_config
    assert parse_speculative_config('{"num_speculative_tokens": 2, "index_share_for_mtp_iteration": true}') == \
        {"num_speculative_tokens": 2, "index_share_for_mtp_iteration": True}
    with pytest.raises(ValueError, match="index_share_for_mtp_iteration must be true, false or null"):
        parse_speculative_config('{"index_share_for_mtp_iteration": "yes"}')
    with pytest.raises(ValueError, match="index_share_for_mtp_iteration must be true, false or null"):
        SpeculativeConfig(index_share_for_mtp_iteration=1)
    off = EngineArgs(model=path, speculative_config={"num_speculative_tokens": 2}).create_engine_config()
    assert off.speculative_config.index_share_for_mtp_iteration is False
    on = EngineArgs(model=path, speculative_config={"num_speculative_tokens": 2,
                                                    "index_share_for_mtp_iteration": True})
    with pytest.raises(ValueError, match="needs a sparse-attention model with an indexer.*Glm4MoeForCausalLM has none"):
        on.create_engine_config()


def test_prefix_caching_flags(path) -> None:
    """vLLM's spellings: on by default, ``--no-enable-prefix-caching`` turns it off; the value reaches
    the cache config, ``LLM(...)``'s keyword arguments and the server's engine info."""
    assert _engine([]).enable_prefix_caching is True
    assert _engine(["--model", path]).create_engine_config().cache_config.enable_prefix_caching is True
    off = _engine(["--model", path, "--no-enable-prefix-caching"])
    assert off.llm_kwargs()["enable_prefix_caching"] is False
    assert off.create_engine_config().cache_config.enable_prefix_caching is False
    check_serve_args(["--no-enable-prefix-caching"])
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    args = p.parse_args(["--model", path, "--no-enable-prefix-caching"])
    assert engine_info(args, llm_kwargs(args), None)["enable_prefix_caching"] is False
    with pytest.raises(ValueError, match="enable_prefix_caching must be True or False"):
        CacheConfig(enable_prefix_caching="yes")


def test_serve_takes_the_model_positionally_like_vllm_serve(capsys) -> None:
    """``mtpspec serve MODEL`` (vLLM's form) means ``--model MODEL``; both, differing, is an error."""
    from mtpspec.entrypoints.cli import main
    assert main(["serve", "/no/such/model-folder", "--port", "0"]) == 2
    assert "no folder '/no/such/model-folder'" in capsys.readouterr().err
    assert main(["serve", "/a", "--model", "/b", "--port", "0"]) == 2
    assert "the model is given twice: '/a' (positional) and --model '/b'" in capsys.readouterr().err


def test_human_readable_max_model_len_as_vllm():
    from mtpspec.engine.arg_utils import human_readable_int
    for text, want in (("4096", 4096), ("4k", 4000), ("25.6k", 25600), ("4K", 4096), ("1M", 1048576), ("2g", 2 * 10 ** 9),
                       (" 8K ", 8192), ("32.7k", 32700), ("16.1k", 16100)):
        assert human_readable_int(text) == want, text
    for bad in ("4.5K", "abc", "k", "1.5", "", "0.0001k", "1e3k", "nank", "-1k"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected a whole number"):
            human_readable_int(bad)
    assert _engine(["--max-model-len", "1k"]).max_model_len == 1000


def test_dtype_auto_and_vllm_method_aliases(path):
    """``--dtype auto`` is the checkpoint's dtype (vLLM's default spelling); ``deepseek_mtp`` and the
    other ``<model>_mtp`` names of vLLM mean ``mtp``; anything else is still named in the error."""
    cfg = EngineArgs(model=path, dtype="auto", device="cpu", speculative_config=None).create_engine_config()
    assert cfg.dtype is None
    from mtpspec.models.loader import _resolve
    assert _resolve("auto", "cpu", cfg.model_config)[0] == cfg.model_config.dtype
    for method in ("deepseek_mtp", "glm4_moe_mtp"):
        spec = _spec(["--speculative-config", json.dumps({"method": method, "num_speculative_tokens": 2})])
        assert spec.method == "mtp" and spec.num_speculative_tokens == 2
        assert SpeculativeConfig(method=method).method == "mtp"
    with pytest.raises(ValueError, match="method must be 'mtp'.*got 'eagle3'"):
        _spec(["--speculative-config", '{"method": "eagle3"}'])


def test_mtp_without_mtp_layers_says_why_and_what_to_do(path, tmp_path):
    """A config without ``num_nextn_predict_layers`` (transformers' DeepseekV32Config / GlmMoeDsaConfig
    write none) is told apart from one that declares 0, and both messages say how to run it."""
    import shutil
    with open(f"{path}/config.json") as f:
        raw = json.load(f)
    for key_present in (True, False):
        d = tmp_path / f"m{key_present}"
        d.mkdir()
        for name in os.listdir(path):
            if name != "config.json":
                shutil.copy(f"{path}/{name}", d / name)
        cfg = {k: v for k, v in raw.items() if k != "num_nextn_predict_layers"}
        if key_present:
            cfg["num_nextn_predict_layers"] = 0
        (d / "config.json").write_text(json.dumps(cfg))
        want = "declares num_nextn_predict_layers = 0" if key_present else "has no num_nextn_predict_layers"
        with pytest.raises(ValueError, match=f"{want}.*-k 0, speculative_config=None"):
            EngineArgs(model=str(d), device="cpu", speculative_config={"num_speculative_tokens": 1}
                       ).create_engine_config()


def test_cpu_kv_cache_gib_flag_sizes_the_cpu_cache() -> None:
    """``--cpu-kv-cache-gib`` (the CPU KV budget, before only ``LLM(cpu_kv_cache_gib=...)``) reaches the engine
    config; a non-positive one is a clear error naming it."""
    import argparse as _ap
    p = _ap.ArgumentParser()
    EngineArgs.add_cli_args(p)
    assert EngineArgs.from_cli_args(p.parse_args(["--cpu-kv-cache-gib", "0.25"])).cpu_kv_cache_gib == 0.25
    assert EngineArgs.from_cli_args(p.parse_args([])).cpu_kv_cache_gib == 1.0
    with pytest.raises(ValueError, match=r"cpu_kv_cache_gib \(CLI: --cpu-kv-cache-gib\) must be > 0"):
        EngineArgs.from_cli_args(p.parse_args(["--cpu-kv-cache-gib", "0"])).create_engine_config()


def test_a_seed_that_is_not_an_int_and_a_tokenizer_path_without_one_fail_at_construction(path, tmp_path) -> None:
    """Found by a new-user pass: ``seed="x"`` / ``seed=1.5`` were taken, and ``tokenizer="/nonexistent"``
    too, until ``generate`` said "the model folder has none" (the folder has one: the path was wrong)."""
    for seed in ("x", 1.5, True):
        with pytest.raises(TypeError, match="seed must be an int"):
            EngineArgs(model=path, seed=seed).create_engine_config()
    assert EngineArgs(model=path, seed=None).create_engine_config().seed is None  # None: random
    import numpy as np
    seed = EngineArgs(model=path, seed=np.int64(3)).create_engine_config().seed  # a numpy int: a Python int
    assert seed == 3 and type(seed) is int
    for tok in ("/nonexistent", str(tmp_path)):
        with pytest.raises(ValueError, match="no tokenizer there"):
            LLM(path, tokenizer=tok, max_model_len=48, num_kv_blocks=16)


def test_vllm_s_trust_remote_code_is_accepted_and_a_model_that_is_not_a_path_is_a_clear_error(path) -> None:
    """vLLM command lines carry ``--trust-remote-code`` (DeepSeek-V3's model card's does): accepted by
    every command's engine flags and by ``LLM()``, changing nothing; ``LLM(model=None)`` was a raw
    ``os.stat`` TypeError (a new-user pass)."""
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    args = p.parse_args(["--model", path, "--trust-remote-code"])
    assert args.trust_remote_code and EngineArgs.from_cli_args(args).model == path
    with LLM(path, trust_remote_code=True, max_model_len=48, num_kv_blocks=16) as llm:
        assert llm.model_config.vocab_size > 0
    with pytest.raises(TypeError, match="model must be a checkpoint folder"):
        LLM(None)


def test_underscored_long_options_as_vllm(capsys, monkeypatch) -> None:
    """A new-user pass (2026-12-05): vLLM's parser takes ``--tensor_parallel_size`` and
    ``--max_model_len=1024`` as the dashed options; mtpspec's refused them. Values are left alone."""
    from mtpspec.entrypoints import cli
    from mtpspec.entrypoints.cli import _dashed
    assert _dashed(["serve", "--tensor_parallel_size", "1", "--speculative_config", '{"num_speculative_tokens": 2}',
                    "--max_model_len=1_024", "-k", "3", "--", "--a_b"]) == [
        "serve", "--tensor-parallel-size", "1", "--speculative-config", '{"num_speculative_tokens": 2}',
        "--max-model-len=1_024", "-k", "3", "--", "--a_b"]
    # a word with a space is a value, as argparse reads it (a review: bench arms --server-args' documented form)
    for value in ('--speculative-config {"num_speculative_tokens": 3}', "--model /ckpt/glm_air", "--a_b c"):
        assert _dashed(["bench", "arms", "--server-args", value, "--prompt", value]) == [
            "bench", "arms", "--server-args", value, "--prompt", value]
    seen = {}
    monkeypatch.setattr(generate, "run", lambda args: seen.update(vars(args)) or 0)
    assert cli.main(["generate", "--max_model_len=64", "--num_speculative_tokens", "1", "--prompt", "a_b"]) == 0
    assert seen["max_model_len"] == 64 and seen["num_speculative_tokens"] == 1 and seen["prompt"] == ["a_b"]


def test_tokenizer_flag_reaches_llm(path, tmp_path) -> None:
    """``--tokenizer FOLDER`` (vLLM's flag) is ``LLM(tokenizer=FOLDER)``; a folder without one is named."""
    assert _engine(["--tokenizer", "/tok"]).llm_kwargs()["tokenizer"] == "/tok"
    assert _engine([]).llm_kwargs()["tokenizer"] is None
    with pytest.raises(ValueError, match="no tokenizer there"):
        LLM(**_engine(["--model", path, "--device", "cpu", "--tokenizer", str(tmp_path)]).llm_kwargs())


def test_serve_takes_vllm_log_flags_and_refuses_an_empty_api_key(capsys) -> None:
    """``--disable-log-requests`` / ``--disable-log-stats`` (vLLM scripts carry them) are accepted; an empty
    ``--api-key`` is an error before the model loads."""
    from mtpspec.entrypoints.cli import main
    assert main(["serve", "--disable-log-requests", "--disable-log-stats", "--api_key=", "--port", "0",
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--api-key must not be empty" in err and "unrecognized" not in err


def test_vllm_only_llm_arguments_at_their_default_are_accepted_others_named(path) -> None:
    """vLLM's ``LLM(...)`` arguments mtpspec lacks were "unexpected keyword argument" even at their
    default (``pipeline_parallel_size=1``, copied from vLLM scripts); now dropped there, and any other
    value is a TypeError naming the argument and what mtpspec does instead (before anything loads)."""
    from mtpspec.engine.arg_utils import VLLM_ONLY_ARGS
    defaults = dict(revision=None, tokenizer_revision=None, code_revision=None, tokenizer_mode="auto",
                    quantization=None, enable_lora=False, max_lora_rank=16, pipeline_parallel_size=1,
                    swap_space=4, cpu_offload_gb=0, hf_overrides={}, distributed_executor_backend=None,
                    disable_log_stats=True, logits_processors=[], scheduling_policy="fcfs")
    assert set(defaults) <= set(VLLM_ONLY_ARGS)
    with LLM(path, max_model_len=48, num_kv_blocks=16, **defaults) as llm:
        assert llm.generate([{"prompt_token_ids": [5]}], SamplingParams(max_tokens=2), use_tqdm=False)
    LLM(path, max_model_len=48, num_kv_blocks=16, disable_log_stats=False).shutdown()  # mtpspec logs none either way
    for kw, match in [(dict(pipeline_parallel_size=2), "runs tensor parallelism only"),
                      (dict(quantization="fp8"), "quantizes nothing on load"),
                      (dict(enable_lora=True), "serves no LoRA adapters"),
                      (dict(enable_lora=0), r"accepted only as False"),  # not a bool: not vLLM's default
                      (dict(revision="main"), "downloads nothing"),
                      (dict(swap_space=16), "recomputes a preempted sequence"),
                      (dict(cpu_offload_gb=8), "keeps every weight on the device"),
                      (dict(hf_overrides={"num_hidden_layers": 1}), "reads config.json as it is"),
                      (dict(distributed_executor_backend="ray"), "one process per rank"),
                      (dict(disable_log_stats="yes"), "accepted only as True or False")]:
        name = next(iter(kw))
        with pytest.raises(TypeError, match=rf"LLM\({name}=.*: a vLLM argument mtpspec does not implement; .*{match}"):
            LLM("/no/such/folder", **kw)  # refused before the path is looked at
    with pytest.raises(TypeError, match="LLM\\(\\) got an unexpected keyword argument 'max_num_seq'"):
        LLM(path, max_num_seq=4)


def test_bool_flags_refuse_other_values(path) -> None:
    """``LLM(enforce_eager="false")`` turned CUDA graphs off (a non-empty string is true), and
    ``disable_shared_experts_fusion`` / ``trust_remote_code`` took anything: every bool argument of
    ``LLM(...)`` / ``EngineArgs`` now refuses a non-bool, naming it; numpy bools are taken as bools."""
    import numpy as np
    from dataclasses import fields
    flags = [f.name for f in fields(EngineArgs) if f.type == "bool"]
    assert {"enforce_eager", "enable_prefix_caching", "async_scheduling", "enable_chunked_prefill",
            "disable_shared_experts_fusion", "sequence_parallel", "fuse_allreduce_rmsnorm"} <= set(flags)
    for name in flags:
        for bad in ("false", 0, 1, None):
            with pytest.raises(ValueError, match=f"{name} must be True or False, got {bad!r}"):
                EngineArgs(**{name: bad})
    for name in ("enforce_eager", "disable_shared_experts_fusion", "trust_remote_code"):
        with pytest.raises(ValueError, match=f"{name} must be True or False, got 'false'"):
            LLM(path, max_model_len=48, num_kv_blocks=16, **{name: "false"})
    args = EngineArgs(model=path, enforce_eager=np.bool_(True), enable_prefix_caching=np.True_)
    assert args.enforce_eager is True and args.enable_prefix_caching is True
    with LLM(path, max_model_len=48, num_kv_blocks=16, enforce_eager=np.bool_(True),
             trust_remote_code=np.False_) as llm:
        assert llm.engine_config.graph_mode == "off"
