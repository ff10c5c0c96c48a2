"""Start, drive and stop vLLM instances for the end-to-end tests (see engine_proc.py).

Every engine runs in its own process group, so stopping one stops the engine core and
worker processes vLLM spawned under it, and nothing else.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvxfer.testing import lines
from kvxfer.testing.ports import free_port  # noqa: F401  # re-exported: the vLLM tests import it from here

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TOKEN_ENV = "KVXFER_E2E_TOKEN"
#: Generous: the CI machine has 2 cores shared by several vLLM starts.
START_TIMEOUT = float(os.environ.get("KVXFER_E2E_START_TIMEOUT", "900"))
CALL_TIMEOUT = 300.0
#: Log lines after which an engine cannot answer any more.
WEDGED = ("Exception in thread nixl_handshake_listener",)


def write_tiny_llama(folder: Path) -> Path:
    """A 4-layer Llama (hidden 128, 4 heads of 32, 2 KV heads) with seeded random weights, saved locally.

    Not vLLM's ``load_format="dummy"``: its weights (uniform in +-1e-3) make attention almost
    uniform, so the greedy tokens barely depend on the prompt's KV and even loading another
    prompt's KV left them unchanged. With weights drawn at ``initializer_range=0.2`` they do
    depend on it, which the control test checks.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         initializer_range=0.2, torch_dtype="float32")
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


def pair_cpus() -> tuple[str | None, str | None]:
    """Cores for a prefill and its decode: the first and the last this process may use.

    vLLM's automatic binding puts both instances of a pair on the same core on a 2-core
    machine (``GOMP_CPU_AFFINITY=0`` in both workers), where a prefill that steps while its
    blocks wait to be read takes that core from the decode reading them. Each still runs
    pinned, as vLLM CPU always does. On one core: vLLM's own choice.
    """
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return None, None
    return (str(cores[0]), str(cores[-1])) if len(cores) >= 2 else (None, None)


@dataclass
class Engine:
    name: str
    proc: subprocess.Popen
    answers: Any
    log_path: Path
    start_seconds: float | None = None
    ready: bool = False
    _ch: lines.Channel = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._ch = lines.Channel(self.proc, replies=self.answers)

    def _read(self, timeout: float) -> dict[str, Any]:
        next_look = [time.monotonic() + 5.0]

        def health() -> None:  # fail at once when the engine died or its log shows it never will answer
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited (rc={self.proc.returncode})\n{self.log_tail()}")
            if time.monotonic() >= next_look[0]:
                next_look[0] = time.monotonic() + 5.0
                self._raise_if_wedged()

        try:
            reply = self._ch.read(timeout, health, idle_s=1.0)
        except TimeoutError:
            raise TimeoutError(f"{self.name}: no answer within {timeout:g} s\n{self.log_tail()}") from None
        except EOFError:
            raise RuntimeError(f"{self.name} exited (rc={self.proc.poll()})\n{self.log_tail()}") from None
        if "error" in reply:
            raise RuntimeError(f"{self.name} failed: {reply['error']}: {reply['message']}\n{self.log_tail()}")
        return reply

    def _raise_if_wedged(self) -> None:
        """Fail now, not at the timeout, once the engine's log shows it can never answer.

        vLLM's NixlConnector runs its handshake listener in a thread; when that thread dies
        (a port taken, say) the engine keeps running and never gets ready.
        """
        try:
            log = self.log_path.read_text(errors="replace")
        except OSError:
            return
        for marker in WEDGED:
            if marker in log:
                raise RuntimeError(f"{self.name}: {marker!r} in its log; it will never answer\n{self.log_tail()}")

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        if not self.ready:
            msg = self._read(timeout)
            assert msg.get("ready"), msg
            self.ready, self.start_seconds = True, msg["start_seconds"]

    def call(self, cmd: dict[str, Any], timeout: float = CALL_TIMEOUT) -> dict[str, Any]:
        self.wait_ready()
        self._ch.send(cmd)
        return self._read(timeout)

    def generate(self, prompts: list[list[int]], max_tokens: int, params: list[Any] | None = None) -> dict[str, Any]:
        return self.call({"cmd": "generate", "prompts": prompts, "max_tokens": max_tokens, "params": params})

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def log_lines(self, needle: str) -> list[str]:
        return [ln for ln in self.log_path.read_text(errors="replace").splitlines() if needle in ln]

    def kill(self) -> None:
        """SIGKILL the engine's whole process group (the engine core and workers with it)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=60)

    def ask_to_exit(self) -> None:
        """Send ``exit`` without waiting: vLLM's shutdown takes seconds (about 5 on CI), which
        several engines can spend together (:func:`stop_all`)."""
        if self.proc.poll() is None:
            try:
                self._ch.send({"cmd": "exit"})
            except OSError:  # gone already: stop() finds it so
                pass

    def stop(self) -> None:
        self._ch.stop(60)  # whether or not it went, its group goes next
        self.kill()
        self._ch.close()
        self.answers.close()


def stop_all(engines: list[Engine]) -> None:
    """Stop engines together: each is asked to exit first, then each is waited for (and its
    group killed) as :meth:`Engine.stop` does. A second ``exit`` is harmless: the first ends it."""
    for e in engines:
        e.ask_to_exit()
    for e in engines:
        e.stop()


def start_engine(name: str, model: Path, logdir: Path, *, kv_transfer_config: dict[str, Any] | None = None,
                 env: dict[str, str] | None = None, blhnc: bool = False, num_blocks: int = 256,
                 cpus: str | None = None, llm_args: dict[str, Any] | None = None, netns: str | None = None) -> Engine:
    """Start one instance in the background; :meth:`Engine.wait_ready` waits for it.

    ``netns``: run it inside that network namespace (another "host", kvxfer._harness.netns).

    ``cpus``: vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` for this instance (a pair's prefill and
    decode get a core each, see :func:`pair_cpus`); None leaves vLLM's automatic binding.
    """
    r, w = os.pipe()
    cfg = {"model": str(model), "fd": w, "kv_transfer_config": kv_transfer_config, "num_blocks": num_blocks,
           "llm_args": llm_args or {}}
    e = dict(os.environ)
    e.update({"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1", "VLLM_LOGGING_LEVEL": "INFO"})
    if blhnc:
        e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE / "blhnc_site"), e.get("PYTHONPATH")]))
        e["VLLM_KV_CACHE_LAYOUT"] = "BLHNC"
    if cpus is not None:
        e["VLLM_CPU_OMP_THREADS_BIND"] = cpus
    e.update(env or {})
    log_path = logdir / f"{name}.log"
    with open(log_path, "wb") as log:
        argv = [sys.executable, str(HERE / "engine_proc.py"), json.dumps(cfg)]
        proc = subprocess.Popen((["ip", "netns", "exec", netns] if netns else []) + argv,
                                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, pass_fds=(w,),
                                env=e, cwd=str(ROOT), start_new_session=True)
    os.close(w)
    return Engine(name, proc, os.fdopen(r, "rb", buffering=0), log_path)
