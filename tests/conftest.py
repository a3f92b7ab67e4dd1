"""Session fixtures: the demo model converted once, and real servers in subprocesses.

The demo model is converted into a session cache dir (``PDPOOL_CACHE``; set it yourself to keep the
conversion across runs). Servers are ``pdpool serve`` subprocesses on free ports, one thread each.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import hypothesis_profiles
from pdpool.node_process import NodeProcess
from redis_server import redis_module  # noqa: F401  (the module-scoped server fixture, for every folder)

# dev by default, ci when CI is set, or HYPOTHESIS_PROFILE=<name>; loaded before any test module builds its
# @settings, which inherit from it (docs/testing.md)
hypothesis_profiles.load()

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SERVER_START_TIMEOUT = 300.0
TESTS = Path(__file__).resolve().parent
# (module, the module it reads the run of): run after it when both are collected (tests/helm/test_chart_rbac.py)
RUN_AFTER = [(TESTS / "helm" / "test_chart_rbac.py", TESTS / "operator" / "test_operator_e2e.py")]


def pytest_collection_modifyitems(items: list) -> None:
    """Each module of ``RUN_AFTER`` moved to just after the module whose run it reads, where both are collected,
    so that it reads that run instead of running the module again."""
    for module, after in RUN_AFTER:
        moved = [item for item in items if item.path == module]
        rest = [item for item in items if item.path != module]
        last = max((i for i, item in enumerate(rest) if item.path == after), default=None)
        if moved and last is not None:
            items[:] = rest[:last + 1] + moved + rest[last + 1:]


@pytest.fixture(scope="session")
def pdpool_cache(tmp_path_factory) -> Path:
    if os.environ.get("PDPOOL_CACHE"):
        return Path(os.environ["PDPOOL_CACHE"])
    path = tmp_path_factory.mktemp("pdpool-cache")
    os.environ["PDPOOL_CACHE"] = str(path)  # inherited by server subprocesses
    return path


@pytest.fixture(scope="session")
def demo_model_dir(pdpool_cache) -> Path:
    """The demo model as a safetensors folder (converted once per session)."""
    from pdpool.models.demo import resolve_model

    return Path(resolve_model("demo"))


class Server(NodeProcess):
    """A ``pdpool serve`` subprocess."""

    def __init__(self, args: list[str], log_path: Path, api_key: str | None = None) -> None:
        super().__init__("server")
        self.api_key = api_key
        env = dict(os.environ)
        env.pop("PDPOOL_API_KEY", None)
        if api_key:
            env["PDPOOL_API_KEY"] = api_key  # from the environment, not argv
        self.launch(self.serve_argv(list(args)), env, log_path)

    def wait_ready(self, timeout: float = SERVER_START_TIMEOUT) -> "Server":
        return super().wait_ready(timeout)

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key or "unused", max_retries=0,
                             timeout=kw.pop("timeout", 300), **kw)

    def async_client(self, **kw):
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key or "unused", max_retries=0,
                                  timeout=kw.pop("timeout", 300), **kw)

    def greedy_token_ids(self, prompts: list, max_tokens: int, **extra) -> list[list[int]]:
        """Greedy completions of all ``prompts`` sent at once (so they share steps); their output token ids."""
        import asyncio

        async def run():
            client = self.async_client()
            try:
                return await asyncio.gather(*[
                    client.completions.create(model="demo", prompt=p, max_tokens=max_tokens, temperature=0,
                                              extra_body={"return_token_ids": True, **extra}) for p in prompts])
            finally:
                await client.close()

        return [r.choices[0].model_extra["token_ids"] for r in asyncio.run(run())]

    def greedy_token_ids_beside(self, reference, prompts: list, max_tokens: int, **extra) -> tuple[list, object]:
        """(``greedy_token_ids`` once the node is ready, ``reference()``): the reference (HF's, one torch thread)
        runs in a thread meanwhile, on the core the node (one torch thread) leaves free as it starts and answers."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as pool:
            expected = pool.submit(reference)
            return self.wait_ready().greedy_token_ids(prompts, max_tokens, **extra), expected.result()

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@pytest.fixture(scope="session")
def launch_server(demo_model_dir, tmp_path_factory):
    """``launch_server(*flags, api_key=None, wait=True)`` starts a server and stops it at the end of the session
    (module fixtures stop theirs earlier with ``server.stop()``). With ``wait=False`` it returns at once: the test
    does other work while the node starts (a few seconds of one core), then calls ``server.wait_ready()``."""
    started: list[Server] = []

    def launch(*flags: str, api_key: str | None = None, wait: bool = True) -> Server:
        log = tmp_path_factory.mktemp("server") / "server.log"
        server = Server(list(flags), log, api_key=api_key)
        started.append(server)
        if not wait:
            return server
        try:
            return server.wait_ready()
        except BaseException:
            server.stop()
            raise

    yield launch
    for server in started:
        server.stop()


class HFReference:
    """HF transformers on the converted demo folder: the ground truth for parity tests."""

    def __init__(self, path: Path, dtype: str = "float32") -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(1)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
        self._greedy: dict = {}

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text)["input_ids"]

    def greedy(self, prompt_ids: list[int], max_new_tokens: int, *, ignore_eos: bool = False) -> list[int]:
        """HF's greedy continuation: ``generate`` (stops at EOS like the engine); with ``ignore_eos``, the same
        argmax loop over HF's KV cache without the stop (``generate`` keeps stopping at the model's EOS)."""
        import copy

        import torch

        key = (tuple(prompt_ids), max_new_tokens, ignore_eos)
        if key in self._greedy:
            return self._greedy[key]
        with torch.no_grad():
            if ignore_eos:
                out: list[int] = []
                step_ids, past = prompt_ids, None
                for _ in range(max_new_tokens):
                    o = self.model(input_ids=torch.tensor([step_ids]), past_key_values=past, use_cache=True)
                    past = o.past_key_values
                    out.append(int(o.logits[0, -1].argmax()))
                    step_ids = out[-1:]
            else:
                gen_config = copy.deepcopy(self.model.generation_config)
                gen_config.do_sample, gen_config.max_new_tokens = False, max_new_tokens
                gen_config.repetition_penalty, gen_config.pad_token_id = 1.0, self.tokenizer.eos_token_id
                gen_config.temperature = gen_config.top_p = gen_config.top_k = None
                ids = torch.tensor([prompt_ids])
                out = self.model.generate(ids, generation_config=gen_config, attention_mask=torch.ones_like(ids))
                out = out[0, len(prompt_ids):].tolist()
        self._greedy[key] = out
        return out

    def logprobs(self, prompt_ids: list[int], output_ids: list[int]):
        """log_softmax of HF's logits at each output position: [len(output_ids), vocab] float32."""
        import torch

        ids = torch.tensor([prompt_ids + output_ids])
        with torch.no_grad():
            logits = self.model(ids).logits[0].float()
        n = len(prompt_ids)
        return torch.log_softmax(logits[n - 1:n - 1 + len(output_ids)], dim=-1)


@pytest.fixture(scope="session")
def hf_reference(demo_model_dir) -> HFReference:
    return HFReference(demo_model_dir)


@pytest.fixture(scope="session")
def hf_reference_bf16(demo_model_dir) -> HFReference:
    return HFReference(demo_model_dir, "bfloat16")
