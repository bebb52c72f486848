"""`scripts/serve_hybrid.py` start-up failures: the operator gets exit status 2 and one line
"cannot start: <reason>" on stderr, not a traceback; flags out of range are usage errors."""
import json
import os
import shutil
import socket
import subprocess
import sys

import httpx
import pytest

from hybrid_engine.server.cli import engine_config, parse_args
from tests.models.conftest import make_hf_checkpoint
from tests.server.conftest import SERVE_SCRIPT, free_port, start_subprocess_server


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("ckpt")
    make_hf_checkpoint(path, "nemotron_moe")
    return str(path)


def _copy(checkpoint: str, dst) -> str:
    shutil.copytree(checkpoint, dst)
    return str(dst)


def _start_fails(*flags: str) -> str:
    """Run the server with `flags`; assert it exits 2 printing exactly one "cannot start" line; return it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    flags = ("--host", "127.0.0.1", "--device", "cpu", "--log-level", "warning") + flags
    proc = subprocess.run([sys.executable, str(SERVE_SCRIPT), *flags], capture_output=True, text=True, env=env,
                          timeout=300)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("cannot start: "), proc.stderr
    return lines[0]


def test_port_out_of_range():
    assert _start_fails("--port", "99999") == "cannot start: --port must be in 0..65535, got 99999"


def test_port_in_use():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = _start_fails("--port", str(port))
    assert line.startswith(f"cannot start: cannot listen on 127.0.0.1:{port}: ")


def test_truncated_safetensors(checkpoint, tmp_path):
    path = _copy(checkpoint, tmp_path / "truncated")
    file = os.path.join(path, "model.safetensors")
    os.truncate(file, os.path.getsize(file) // 2)
    line = _start_fails("--port", str(free_port()), "--model", path)
    assert line.startswith(f"cannot start: cannot read {file}: ")


def test_bad_tokenizer_file(checkpoint, tmp_path):
    path = _copy(checkpoint, tmp_path / "bad_tokenizer")
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        f.write('{"version": "1.0", "model": ')
    line = _start_fails("--port", str(free_port()), "--model", path)
    assert line.startswith(f"cannot start: failed to load the tokenizer in {path!r} (tokenizer.json): ")


def test_pools_larger_than_host_memory():
    """10^8 requests' Mamba states and KV cache (hundreds of TiB) cannot be allocated."""
    line = _start_fails("--port", str(free_port()), "--max-num-seqs", "100000000")
    assert line.startswith("cannot start: not enough host memory for 100000000 Mamba state slots"), line


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_shutdown_timeout_must_be_finite_and_non_negative(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--shutdown-timeout", value])
    assert exit_info.value.code == 2
    assert "--shutdown-timeout must be a finite number of seconds >= 0" in capsys.readouterr().err
    assert parse_args(["--shutdown-timeout", "0"]).shutdown_timeout == 0.0


@pytest.mark.parametrize("flag, value, message", [
    ("--max-request-body-bytes", "0", "--max-request-body-bytes must be an integer >= 1, got 0"),
    ("--max-connections", "-3", "--max-connections must be an integer >= 1, got -3"),
    ("--timeout-keep-alive", "0", "--timeout-keep-alive must be a finite number of seconds > 0, got 0.0"),
    ("--request-read-timeout", "nan", "--request-read-timeout must be a finite number of seconds > 0, got nan"),
])
def test_server_limits_must_be_positive(flag, value, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args([flag, value])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_server_limit_defaults():
    limits = parse_args([]).limits
    assert (limits.max_request_body_bytes, limits.max_connections, limits.timeout_keep_alive,
            limits.request_read_timeout) == (8 * 1024 * 1024, 2048, 5.0, 30.0)


def test_speculative_config_flag(capsys):
    args = parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert engine_config(args).speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    assert engine_config(parse_args([])).speculative_config is None
    draft = {"method": "draft_model", "model": "preset:nemotron-h-8b", "num_speculative_tokens": 4}
    assert engine_config(parse_args(["--speculative-config", json.dumps(draft)])).speculative_config == draft
    for value, message in [("{not json", "must be a JSON object"), ("[1]", "must be a JSON object"),
                           ('{"method": "draft_model", "num_speculative_tokens": 2}', "speculative_config.model"),
                           ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
                           ('{"method": "proposer", "num_speculative_tokens": 2}', "use the library")]:
        with pytest.raises(SystemExit) as exit_info:
            parse_args(["--speculative-config", value])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def test_chat_template_flag_takes_a_template_or_a_file(tmp_path, capsys):
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert parse_args(["--chat-template", template]).chat_template == template
    (tmp_path / "t.jinja").write_text(template)
    assert parse_args(["--chat-template", str(tmp_path / "t.jinja")]).chat_template == template
    assert parse_args([]).chat_template is None
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--chat-template", str(tmp_path / "missing.jinja")])
    assert exit_info.value.code == 2 and "--chat-template: [Errno 2]" in capsys.readouterr().err


def test_chat_template_that_does_not_parse():
    line = _start_fails("--port", str(free_port()), "--chat-template", "{% for m in messages %}\n{{ m.content }")
    assert line == "cannot start: --chat-template: line 2: unexpected '}'"


def test_an_empty_chat_template_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "empty.jinja").write_text("\n")
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--chat-template", str(tmp_path / "empty.jinja")])
    assert exit_info.value.code == 2 and "--chat-template: the template is empty" in capsys.readouterr().err


def test_chat_template_serves_chat(tmp_path):
    """The server renders chat and /tokenize with the flag's template, not the tokenizer's."""
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    messages = [{"role": "user", "content": "hi"}]
    with start_subprocess_server("--device", "cpu", "--chat-template", str(tmp_path / "t.jinja")) as (url, _):
        tokens = httpx.post(f"{url}/tokenize", json={"messages": messages}, timeout=60).json()["tokens"]
        chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 1}, timeout=60)
    assert bytes(tokens) == b"[user] hi\n"
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == len(tokens)


def test_reasoning_parser_flag():
    assert parse_args([]).reasoning_parser is None
    assert parse_args(["--reasoning-parser", "nemotron_v3"]).reasoning_parser == "nemotron_v3"
    with pytest.raises(SystemExit):  # argparse: a usage error listing the names
        parse_args(["--reasoning-parser", "granite"])


def test_tool_call_flags(capsys):
    args = parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert (args.enable_auto_tool_choice, args.tool_call_parser) == (True, "hermes")
    assert parse_args(["--tool-call-parser", "nemotron_json"]).enable_auto_tool_choice is False
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--enable-auto-tool-choice"])
    assert exit_info.value.code == 2 and "--enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err


def test_served_model_names():
    assert parse_args([]).served_model_name is None
    assert parse_args(["--served-model-name", "a", "b/c"]).served_model_name == ["a", "b/c"]


def test_mamba_ssm_cache_dtype_flag():
    assert engine_config(parse_args([])).mamba_ssm_cache_dtype == "auto"
    assert engine_config(parse_args(["--mamba-ssm-cache-dtype", "bfloat16"])).mamba_ssm_cache_dtype == "bfloat16"
    with pytest.raises(SystemExit):  # argparse: a usage error listing the choices
        parse_args(["--mamba-ssm-cache-dtype", "fp8"])


def test_prefix_cache_flags_reach_the_engine_config():
    default = engine_config(parse_args([]))
    assert (default.enable_prefix_caching, default.prefix_cache_max_checkpoints,
            default.prefix_cache_checkpoint_interval) == (True, None, None)
    config = engine_config(parse_args(["--no-enable-prefix-caching", "--prefix-cache-max-checkpoints", "0",
                                       "--kv-block-size", "32", "--prefix-cache-checkpoint-interval", "96"]))
    assert (config.enable_prefix_caching, config.prefix_cache_max_checkpoints,
            config.prefix_cache_checkpoint_interval) == (False, 0, 96)
    assert engine_config(parse_args(["--enable-prefix-caching"])).enable_prefix_caching is True


def test_every_engine_flag_gives_a_config_of_the_right_types():
    """argparse types each engine flag as its EngineConfig field: the config resolves."""
    args = parse_args(["--model", "preset:granite-4.0-h-micro", "--device", "cpu", "--dtype", "float32",
                       "--mamba-ssm-cache-dtype", "bfloat16", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
                       "--max-model-len", "128", "--num-kv-blocks", "32", "--kv-block-size", "16",
                       "--gpu-memory-utilization", "1", "--seed", "7", "--load-format", "dummy",
                       "--no-async-scheduling", "--no-cuda-graphs", "--no-enable-prefix-caching",
                       "--prefix-cache-max-checkpoints", "2", "--prefix-cache-checkpoint-interval", "32",
                       "--tensor-parallel-size", "2", "--enable-expert-parallel",
                       "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    config = engine_config(args).resolve()
    assert (config.gpu_memory_utilization, config.seed, config.async_scheduling) == (1.0, 7, False)
    assert engine_config(parse_args(["--device", "cpu"])).resolve().enable_prefix_caching is True


@pytest.mark.parametrize("flags, message", [
    (["--prefix-cache-max-checkpoints", "-1"], "--prefix-cache-max-checkpoints must be >= 0, got -1"),
    (["--prefix-cache-checkpoint-interval", "0"], "--prefix-cache-checkpoint-interval must be >= 1, got 0"),
    (["--kv-block-size", "32", "--prefix-cache-checkpoint-interval", "48"],
     "--prefix-cache-checkpoint-interval must be a multiple of the KV block size (32 tokens; --kv-block-size), "
     "got 48"),
    # Without --kv-block-size: the device's default (16 on CPU).
    (["--device", "cpu", "--prefix-cache-checkpoint-interval", "24"],
     "--prefix-cache-checkpoint-interval must be a multiple of the KV block size (16 tokens"),
    (["--prefix-cache-checkpoint-interval", "many"], "--prefix-cache-checkpoint-interval: invalid int value"),
])
def test_bad_prefix_cache_flags_are_usage_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(flags)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
