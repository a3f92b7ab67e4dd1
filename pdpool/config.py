"""The one configuration schema of pdpool.

Every setting of the engine, the node server, KV transfer and the router is
declared here once, with its name, type, default, bounds and help. The CLI
flags are generated from it (``add_arguments``), the InferencePool CRD schema
is generated from it (``crd`` paths), and so are ``pdpool up``'s defaults.

Names: the Python attribute is ``snake_case``; the CLI flag is the same name
with dashes (``--max-num-seqs``); the CRD field is the ``crd`` path in
camelCase (``engine.maxNumSeqs``).

Secrets (``secret=True``) may also come from ``PDPOOL_<NAME>`` in the
environment or from a file named by ``--<name>-file``, so they never need to
appear in argv.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import socket
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin

import yaml

ROLES = ("both", "prefill", "decode")
DEVICES = ("cpu", "cuda")
DTYPES = ("auto", "bfloat16", "float16", "float32")
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "pythonic")   # pdpool.server.tool_parsers.PARSERS
_AUTO_TOOL_HELP = ("Serve tool_choice \"auto\" (the default with tools): the model's own tool-call format, read by "
                   "--tool-call-parser, becomes message.tool_calls (vLLM's flag).")
_PARSER_HELP = "The model's tool-call format, for --enable-auto-tool-choice (vLLM's names)."
_CHAT_TEMPLATE_HELP = ("The chat template in place of the model's (vLLM's flag): a file's path, or the jinja text "
                       "itself (with escapes such as \\n undone).")
# CORS, as vLLM's flags (Starlette's CORSMiddleware; pdpool.server.cors): a list flag takes a JSON list, as vLLM's
# --allowed-origins '["https://app.example"]', or one value per flag, repeated.
# Unset: IPv4 and IPv6 both, each its own socket (pdpool.utils.bind_sockets): a kubelet probes the pod's IP, which is
# IPv6 only in an IPv6-only cluster, where 0.0.0.0 was refused.
LISTEN_HELP = "Address to listen on (default: every address, IPv4 and IPv6)."
HEADER_VALUE = "^[ -~]+$"   # a value sent in a response header as it is: printable ASCII, not empty
_ORIGINS_HELP = "Origins a browser may call from (CORS), a JSON list or repeated; * (the default): any (vLLM's flag)."
_CREDENTIALS_HELP = "CORS: allow a browser's credentials (cookies, HTTP authentication) (vLLM's flag)."
_METHODS_HELP = "Methods a CORS preflight allows, a JSON list or repeated; * (the default): all (vLLM's flag)."
_HEADERS_HELP = "Request headers a CORS preflight allows, a JSON list or repeated; * (the default): any (vLLM's flag)."


def opt(default: Any, help: str, *, choices: tuple | None = None, ge: float | None = None,
        le: float | None = None, secret: bool = False, crd: str | None = None,
        flag: bool = True, pattern: str | None = None) -> Any:
    """Declare one setting. ``crd`` is its path in the InferencePool spec, or None. ``pattern`` (anchored, ``^...$``,
    as the CRD's schema takes it) is what each value (each item of a list) must match: the CRD refuses others at
    apply time, and the config check refuses them anywhere else."""
    meta = dict(help=help, choices=choices, ge=ge, le=le, secret=secret, crd=crd, flag=flag, pattern=pattern)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


class ConfigError(ValueError):
    """A setting is missing, out of range, or inconsistent with another."""


def served_model_name_opt(help: str = "Name the API serves the model as (default: --model).") -> Any:
    """``--served-model-name``, as ``pdpool serve`` and ``pdpool router`` take it: several names, as vLLM's flag
    takes them (--served-model-name a b): a request may name any, /v1/models lists them all, answers carry the
    first. A pool's spec (the CRD's help is the node's) names one."""
    return opt(None, help, crd="model.servedModelName")


def served_model_names(served: str | list[str] | None, model: str) -> list[str]:
    """The names a ``served_model_name_opt`` setting serves (``model`` without one); the first is the one answers,
    metrics and block-hash fingerprints carry."""
    names = served or model
    return [names] if isinstance(names, str) else list(names)


@dataclass
class ModelConfig:
    model: str = opt("demo", "Model: 'demo' (bundled SmolLM2-135M-Instruct), a local HF folder, or a hub id "
                     "already in the Hugging Face cache (never downloaded).",
                     crd="model.name")
    served_model_name: str | list[str] | None = served_model_name_opt()
    dtype: str = opt("auto", "Weight and activation dtype; auto is bfloat16 on CUDA and on CPUs with native bf16 "
                              "(AVX512_BF16, AMX), float32 on other CPUs.",
                     choices=DTYPES, crd="engine.dtype")
    load_format: str = opt("auto", "auto reads safetensors; dummy fills real shapes with random weights.",
                           choices=("auto", "dummy"))
    seed: int = opt(0, "Seed for dummy weights and unseeded sampling.", ge=0)
    chat_template: str | None = opt(None, _CHAT_TEMPLATE_HELP, crd="model.chatTemplate")
    generation_config: str = opt(
        "auto", "Where a request's unset sampling fields get their defaults, as vLLM's flag: 'auto' reads the "
        "model's generation_config.json (temperature, top_p, top_k, min_p, the three penalties, and max_new_tokens "
        "as max_tokens); 'vllm' keeps the neutral defaults; else a folder holding a generation_config.json.",
        crd="model.generationConfig")
    override_generation_config: str | None = opt(
        None, "A JSON object over those defaults, as vLLM's flag: '{\"temperature\": 0.5}'.")


@dataclass
class CacheConfig:
    block_size: int = opt(16, "Tokens per KV block.", choices=(8, 16, 32, 64, 128), crd="engine.blockSize")
    num_kv_blocks: int | None = opt(None, "KV blocks to allocate (default: from memory budget).", ge=1)
    kv_cache_memory_gb: float = opt(1.0, "KV cache size in GiB on CPU.", ge=0.001)
    gpu_memory_utilization: float = opt(0.9, "Fraction of GPU memory for weights, activations and KV.",
                                        ge=0.05, le=0.99, crd="engine.gpuMemoryUtilization")
    enable_prefix_caching: bool = opt(True, "Reuse KV blocks of identical prompt prefixes.")


@dataclass
class SchedulerConfig:
    max_model_len: int | None = opt(None, "Longest prompt plus output (default: the model's).", ge=16,
                                    crd="engine.maxModelLen")
    max_num_seqs: int = opt(64, "Most requests running at once.", ge=1, crd="engine.maxNumSeqs")
    max_num_batched_tokens: int = opt(2048, "Token budget of one engine step; longer prompts are chunked.",
                                      ge=1, crd="engine.maxNumBatchedTokens")
    max_prefill_tokens_with_decodes: int | None = opt(
        None, "Most prompt tokens one step computes while other requests decode (longer prompts are chunked "
        "across steps): lower TTFT, higher TPOT (docs/performance.md); default and 0: only the step budget.", ge=0)
    arrival_wait_ms: float | None = opt(
        None, "With no request running, how long the next step waits for another arrival (ms of quiet, 30 ms in all "
        "at most), so that requests sent together share their first step; a lone request pays it in TTFT. "
        "Default: 4 on CPU, where a prefill step takes seconds; 0 on CUDA.", ge=0, le=30)
    scheduling_policy: str = opt("fcfs", "Order of the waiting queue.", choices=("fcfs", "priority"))
    max_waiting_requests: int | None = opt(1024, "Most requests waiting to be scheduled; beyond it a node answers "
                                           "429.", ge=1, crd="engine.maxWaitingRequests")


@dataclass
class DeviceConfig:
    device: str = opt("cpu", "Where the engine runs.", choices=DEVICES, crd="engine.device")
    enforce_eager: bool = opt(False, "Disable CUDA graphs.")
    num_threads: int | None = opt(None, "torch intra-op threads on CPU (default: torch's).", ge=1)
    attention_backend: str = opt("auto", "Attention implementation; auto is triton on CUDA, cpu (torch with a "
                                 "native decode kernel) on CPU.", choices=("auto", "torch", "cpu", "triton"))


@dataclass
class ServerConfig:
    config: str | None = opt(None, "YAML file of settings keyed by their long flag names (max-model-len or "
                             "max_model_len); a flag on the command line wins over it (vLLM's --config).")
    host: str | None = opt(None, LISTEN_HELP)
    port: int = opt(8000, "HTTP port.", ge=0, le=65535)
    role: str = opt("both", "Node role in a disaggregated pool.", choices=ROLES)
    api_key: str | None = opt(None, "Bearer key clients must present.", secret=True)
    max_log_len: int = opt(0, "Characters of each prompt to log at its arrival, with its request id (0: none).",
                           ge=0)
    enable_auto_tool_choice: bool = opt(False, _AUTO_TOOL_HELP, crd="model.enableAutoToolChoice")
    tool_call_parser: str | None = opt(None, _PARSER_HELP, choices=TOOL_CALL_PARSERS, crd="model.toolCallParser")
    return_tokens_as_token_ids: bool = opt(False, "Logprobs name tokens 'token_id:<id>' unless a request's "
                                           "return_tokens_as_token_ids says otherwise (vLLM's flag).")
    trust_request_chat_template: bool = opt(False, "Take a chat request's own chat_template (jinja, sandboxed; "
                                            "else a 400, as vLLM's flag). A pool's router needs it too.",
                                            crd="model.trustRequestChatTemplate")
    allowed_origins: list[str] = opt(["*"], _ORIGINS_HELP, crd="cors.allowedOrigins", pattern=HEADER_VALUE)
    allow_credentials: bool = opt(False, _CREDENTIALS_HELP, crd="cors.allowCredentials")
    allowed_methods: list[str] = opt(["*"], _METHODS_HELP, crd="cors.allowedMethods", pattern=HEADER_VALUE)
    allowed_headers: list[str] = opt(["*"], _HEADERS_HELP, crd="cors.allowedHeaders", pattern=HEADER_VALUE)


@dataclass
class DisaggConfig:
    redis: str | None = opt(None, "Redis URL for block ownership and peer discovery.", crd="redis.url")
    redis_password: str | None = opt(None, "Redis password.", secret=True)
    pool: str = opt("default", "Pool name; Redis keys are namespaced by it.")
    namespace: str = opt("default", "Kubernetes namespace of the pool.")
    node_id: str | None = opt(None, "Stable node id (default: hostname:port).")
    advertise_host: str | None = opt(None, "Address peers use to reach this node (in a pod: its IP).")
    kv_lease_seconds: float = opt(30.0, "How long a prefill node holds KV for a decode node.", ge=0.05,
                                  crd="kvTransfer.leaseSeconds")
    kv_load_failure_policy: str = opt("recompute", "On a failed KV pull: recompute locally or fail.",
                                      choices=("recompute", "fail"), crd="kvTransfer.failurePolicy")
    kv_transfer_mode: str = opt("pull", "pull: decode READs; push: prefill WRITEs.",
                                choices=("pull", "push"), crd="kvTransfer.mode")
    kv_transfer_timeout: float = opt(10.0, "Seconds before a KV transfer is abandoned.", ge=0.05)
    max_leased_blocks: int | None = opt(None, "Most blocks held under lease; beyond it prefill answers 429.",
                                        ge=1)
    internal_token: str | None = opt(None, "Token the router and peers present to each other.", secret=True)
    heartbeat_seconds: float = opt(2.0, "Seconds between heartbeats to Redis.", ge=0.05)
    ucx_tls: str | None = opt(None, "UCX_TLS for the NIXL agent.", crd="kvTransfer.ucxTls")
    ucx_net_devices: str | None = opt(None, "UCX_NET_DEVICES for the NIXL agent (e.g. mlx5_0:1).",
                                      crd="kvTransfer.ucxNetDevices")
    nixl_port: int = opt(5600, "Port of the NIXL agent's side channel (metadata exchange).", ge=1, le=65535)


@dataclass
class NodeConfig:
    """Everything ``pdpool serve`` takes."""
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)

    def __post_init__(self) -> None:
        validate(self)
        _check_auto_tool_choice(self.server)
        generation_override(self.model)

    @property
    def served_model_names(self) -> list[str]:
        return served_model_names(self.model.served_model_name, self.model.model)

    @property
    def served_model_name(self) -> str:
        """The first served name: the one answers, metrics and block-hash fingerprints carry."""
        return self.served_model_names[0]

    @property
    def node_id(self) -> str:
        return self.disagg.node_id or f"{socket.gethostname()}:{self.server.port}"


@dataclass
class RouterConfig:
    """The OpenAI gateway in front of a pool: picks a prefill and a decode node per request (docs/router.md)."""
    model: str = opt("demo", "Model whose tokenizer the router uses: 'demo', a local HF folder or a cached hub id "
                     "(no weights read).",
                     crd="model.name")
    served_model_name: str | list[str] | None = served_model_name_opt(
        "Name the API serves the model as (default: --model), or several; the first is the model id of the "
        "block-hash fingerprint, and the one the nodes are asked for.")
    dtype: str = opt("auto", "The nodes' dtype, part of the block-hash fingerprint; auto adopts the first node's.",
                     choices=DTYPES, crd="engine.dtype")
    block_size: int = opt(16, "The nodes' tokens per KV block (block hashes).", choices=(8, 16, 32, 64, 128),
                          crd="engine.blockSize")
    config: str | None = opt(None, "YAML file: any of these settings, and the scheduler's filters, scorers and "
                             "picker with their weights (docs/router.md).")
    host: str | None = opt(None, LISTEN_HELP)
    port: int = opt(8000, "HTTP port of the router.", ge=1, le=65535, crd="router.port")
    api_key: str | None = opt(None, "Bearer key clients must present.", secret=True)
    internal_token: str | None = opt(None, "Token the router presents to the nodes.", secret=True)
    redis: str | None = opt(None, "Redis URL where nodes heartbeat and publish block ownership.", crd="redis.url")
    redis_password: str | None = opt(None, "Redis password.", secret=True)
    pool: str = opt("default", "Pool name; Redis keys are namespaced by it, and --kubernetes watches its node "
                    "Services <pool>-prefill and <pool>-decode.")
    namespace: str | None = opt(None, "Kubernetes namespace of the pool (default: --kubernetes watches the pod's "
                                "own, else the kubeconfig context's, else default; Redis keys use default).")
    prefill: list[str] = opt([], "Static prefill node URL (repeatable).")
    decode: list[str] = opt([], "Static decode node URL (repeatable).")
    both: list[str] = opt([], "Static colocated node URL, pdpool or any OpenAI server (repeatable).")
    kubernetes: bool = opt(False, "Discover nodes from the EndpointSlices of the pool's node Services (with "
                           "--redis, Redis is then the prefix index only).")
    kube_api: str | None = opt(None, "Kubernetes API URL (default: the service account's in a pod, else the "
                               "kubeconfig's current context).")
    discovery_seconds: float = opt(0.5, "Seconds between refreshes of the node list and loads.", ge=0.01)
    prefix_weight: float = opt(3.0, "Weight of the prefix-cache-hit scorer.", ge=0, crd="router.weights.prefix")
    queue_weight: float = opt(2.0, "Weight of the queue-depth scorer.", ge=0, crd="router.weights.queue")
    kv_usage_weight: float = opt(2.0, "Weight of the KV-cache-usage scorer.", ge=0, crd="router.weights.kvUsage")
    picker: str = opt("max-score", "How a node is picked from the scores.",
                      choices=("max-score", "round-robin", "random"))
    load_margin_tokens: int = opt(2048, "Prefix affinity yields to load when the best-prefix node's queued prefill "
                                  "tokens exceed the least-loaded node's by more than this.", ge=0)
    # The router counts a prompt's *uncached* tokens on the chosen decode node against it (docs/router.md).
    disagg_min_tokens: int = opt(0, "Prompts shorter than this skip prefill and go to a decode node (0: never).",
                                 ge=0, crd="kvTransfer.disaggMinTokens")
    approx_index_entries: int = opt(100_000, "Block hashes the approximate (router-local) prefix index remembers.",
                                    ge=1)
    index_lookup: str = opt("mirror", "Where the precise prefix lookup runs: 'mirror' (a router-local copy of the "
                            "nodes' block sets, fed by their Redis event stream; no network I/O per request) or "
                            "'redis' (one Lua round trip per request).", choices=("mirror", "redis"))
    max_inflight: int = opt(0, "Requests in flight beyond which the router answers 429 (0: no limit).", ge=0)
    max_retries: int = opt(2, "Decode nodes tried after the first fails before its first byte.", ge=0)
    prefill_timeout: float = opt(60.0, "Seconds before a prefill leg is abandoned (the request goes decode-only).",
                                 ge=0.01)
    connect_timeout: float = opt(2.0, "Seconds to connect to a node.", ge=0.01)
    node_cooldown: float = opt(2.0, "Seconds a node that failed to answer is left out.", ge=0)
    request_timeout: float = opt(600.0, "Seconds a node may take to start its answer, and then between two pieces "
                                 "of it, before the request is abandoned (a stream that keeps coming is never cut).",
                                 ge=1)
    workers: int = opt(1, "Router processes accepting on --port (SO_REUSEPORT), sharing the Redis index and the "
                       "metrics; each counts only its own requests in flight (docs/router.md, Workers).", ge=1, le=64,
                       crd="router.workers")
    recent_seconds: float = opt(5.0, "Seconds a prefix the router just sent to a node counts as held there, before "
                                "the node has published it to Redis (0: off).", ge=0)
    enable_auto_tool_choice: bool = opt(False, _AUTO_TOOL_HELP, crd="model.enableAutoToolChoice")
    tool_call_parser: str | None = opt(None, _PARSER_HELP, choices=TOOL_CALL_PARSERS, crd="model.toolCallParser")
    chat_template: str | None = opt(None, _CHAT_TEMPLATE_HELP + " The router renders chats to route them; give "
                                    "the nodes the same.", crd="model.chatTemplate")
    trust_request_chat_template: bool = opt(False, "Take a chat request's own chat_template (else a 400): the "
                                            "router renders it to route, the nodes to answer; set it on both.",
                                            crd="model.trustRequestChatTemplate")
    token_cache_chunks: int = opt(8192, "Prompt chunks (about 256 characters each) whose token ids the router keeps, "
                                  "so shared system prompts are tokenized once (0: no cache).", ge=0)
    allowed_origins: list[str] = opt(["*"], _ORIGINS_HELP, crd="cors.allowedOrigins", pattern=HEADER_VALUE)
    allow_credentials: bool = opt(False, _CREDENTIALS_HELP, crd="cors.allowCredentials")
    allowed_methods: list[str] = opt(["*"], _METHODS_HELP, crd="cors.allowedMethods", pattern=HEADER_VALUE)
    allowed_headers: list[str] = opt(["*"], _HEADERS_HELP, crd="cors.allowedHeaders", pattern=HEADER_VALUE)


@dataclass
class RouterCommandConfig:
    """Everything ``pdpool router`` takes."""
    router: RouterConfig = field(default_factory=RouterConfig)

    def __post_init__(self) -> None:
        validate(self)
        _check_auto_tool_choice(self.router)

    @property
    def served_model_names(self) -> list[str]:
        return served_model_names(self.router.served_model_name, self.router.model)

    @property
    def served_model_name(self) -> str:
        """The first served name: the nodes' (what requests sent on name) and the block-hash fingerprint's."""
        return self.served_model_names[0]


def _check_auto_tool_choice(section) -> None:
    """vLLM's startup check: auto tool choice needs a parser (a parser alone is allowed, and unused)."""
    if section.enable_auto_tool_choice and not section.tool_call_parser:
        raise ConfigError(f"--enable-auto-tool-choice needs --tool-call-parser (one of "
                          f"{', '.join(TOOL_CALL_PARSERS)}): the model's tool-call format")


def generation_override(section) -> dict:
    """``--override-generation-config`` as a dict (``{}`` when unset); not a JSON object is a ``ConfigError``."""
    text = section.override_generation_config
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ConfigError(f"--override-generation-config must be a JSON object, got {text!r}")
    return value


def matches_pattern(pattern: str, value: str) -> bool:
    """``value`` matches a setting's (a CRD's) ``pattern`` as the API server (Go) searches: its ``$`` is the end of
    the text, where Python's also matches before a final newline."""
    return re.search(pattern[:-1] + r"\Z" if pattern.endswith("$") else pattern, value) is not None


_PATTERN_MEANINGS = {HEADER_VALUE: "a header value (printable ASCII)"}


def auto_tool_parser(section) -> str | None:
    """The parser that serves tool_choice "auto", or None where auto is refused."""
    return section.tool_call_parser if section.enable_auto_tool_choice else None


SECTIONS = {
    "serve": NodeConfig,
    "router": RouterCommandConfig,
}


def sections(cfg_cls: type) -> list[tuple[str, type]]:
    return [(f.name, f.default_factory) for f in dataclasses.fields(cfg_cls)]


def options(section_cls: type) -> list[dataclasses.Field]:
    return list(dataclasses.fields(section_cls))


def all_options(cfg_cls: type = NodeConfig) -> list[tuple[str, dataclasses.Field]]:
    """(section name, field) for every setting of a composite config."""
    return [(sec, f) for sec, cls in sections(cfg_cls) for f in options(cls)]


def _annotation(f: dataclasses.Field) -> Any:
    return eval(f.type, {"Literal": Literal}, {}) if isinstance(f.type, str) else f.type  # postponed strings


def _base_type(f: dataclasses.Field) -> type:
    """The type of the setting's value: list for a repeatable flag; of ``X | None`` and of ``str | list[str]``
    (several values, one allowed alone: ``several``), the first."""
    t = _annotation(f)
    if get_origin(t) is list:  # a repeatable flag
        return list
    if get_origin(t) is not None:  # X | None
        args = [a for a in get_args(t) if a is not type(None)]
        t = args[0]
    return t


def _nullable(f: dataclasses.Field) -> bool:
    return type(None) in get_args(_annotation(f))


def several(f: dataclasses.Field) -> bool:
    """A ``str | list[str]`` setting: its flag takes one value or more (vLLM's ``--served-model-name a b``)."""
    return any(get_origin(a) is list for a in get_args(_annotation(f)))


def flag_name(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


def env_name(f: dataclasses.Field) -> str:
    return "PDPOOL_" + f.name.upper()


def dashed_flags(argv: list[str]) -> list[str]:
    """``argv`` with each flag's name in dashes, as ``vllm serve`` reads ``--max_model_len=4096`` (a value, after
    ``=`` or on its own, is left as it is; so is all after a bare ``--``)."""
    out = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + argv[i:]
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        out.append(arg)
    return out


def _parse_bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {s!r}")


def list_value(text: str) -> list[str]:
    """One list flag's value: a JSON list of strings (vLLM's form, '["a", "b"]'), else one item."""
    if not text.startswith("["):
        return [text]
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser, cfg_cls: type = NodeConfig) -> None:
    """Add one flag per setting (plus --<secret>-file for secrets)."""
    for sec, cls in sections(cfg_cls):
        group = parser.add_argument_group(sec)
        for f in options(cls):
            if not f.metadata.get("flag", True):
                continue
            t = _base_type(f)
            kw: dict[str, Any] = dict(dest=f"{sec}.{f.name}", default=argparse.SUPPRESS, help=f.metadata["help"])
            if t is bool:
                kw["action"] = argparse.BooleanOptionalAction
            elif several(f):   # --served-model-name a b: the list; another --served-model-name replaces it (vLLM's)
                kw.update(nargs="+", metavar=f.name.upper())
            elif t is list:  # repeatable (--decode URL --decode URL) or a JSON list (--decode '["URL", "URL"]')
                kw.update(action="extend", type=list_value, metavar=f.name.upper())
            else:
                kw["type"] = t
                if f.metadata.get("choices"):
                    kw["choices"] = f.metadata["choices"]
                else:
                    kw["metavar"] = f.name.upper()  # not the dest's "SECTION.NAME"
            group.add_argument(flag_name(f), **kw)
            if f.metadata.get("secret"):
                group.add_argument(flag_name(f) + "-file", dest=f"{sec}.{f.name}__file", default=argparse.SUPPRESS, metavar="PATH",
                                   help=f"Read {f.name} from this file (or set {env_name(f)}).")


def from_args(ns: argparse.Namespace, cfg_cls: type = NodeConfig, environ: dict | None = None):
    """Build a validated config from parsed flags, then secret files and environment variables."""
    environ = os.environ if environ is None else environ
    given = vars(ns)
    kwargs = {}
    for sec, cls in sections(cfg_cls):
        values = {}
        for f in options(cls):
            key = f"{sec}.{f.name}"
            if key in given:
                values[f.name] = given[key]
            elif f.metadata.get("secret"):
                if key + "__file" in given:
                    with open(given[key + "__file"]) as fh:
                        values[f.name] = fh.read().strip()
                elif environ.get(env_name(f)):
                    values[f.name] = environ[env_name(f)]
        kwargs[sec] = cls(**values)
    return cfg_cls(**kwargs)


def build(cfg_cls: type = NodeConfig, **flat: Any):
    """Build a config from flat keyword settings: build(model="demo", max_num_seqs=4)."""
    by_name = {f.name: sec for sec, f in all_options(cfg_cls)}
    unknown = set(flat) - set(by_name)
    if unknown:
        raise ConfigError(f"unknown settings: {sorted(unknown)}")
    kwargs: dict[str, dict] = {sec: {} for sec, _ in sections(cfg_cls)}
    for name, value in flat.items():
        kwargs[by_name[name]][name] = value
    return cfg_cls(**{sec: cls(**kwargs[sec]) for sec, cls in sections(cfg_cls)})


def to_argv(cfg, cfg_cls: type = NodeConfig, *, include_secrets: bool = False) -> list[str]:
    """The flags that reproduce ``cfg`` (non-default settings only). Secrets are left out unless asked."""
    argv: list[str] = []
    for sec, cls in sections(cfg_cls):
        section = getattr(cfg, sec)
        for f in options(cls):
            value = getattr(section, f.name)
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if value == default or (f.metadata.get("secret") and not include_secrets):
                continue
            if isinstance(value, bool):
                argv.append(flag_name(f) if value else "--no-" + flag_name(f)[2:])
            elif isinstance(value, list) and several(f):
                argv += [flag_name(f), *map(str, value)]
            elif isinstance(value, list):
                if not value or any(str(item).startswith("[") for item in value):
                    argv += [flag_name(f), json.dumps([str(item) for item in value])]
                else:
                    for item in value:
                        argv += [flag_name(f), str(item)]
            else:
                argv += [flag_name(f), str(value)]
    return argv


def _check_field(f: dataclasses.Field, value: Any, name: str | None = None) -> None:
    """``value`` is of the setting's type, within its choices, bounds and pattern; else a ConfigError that names
    the setting as ``name`` (default: its flag)."""
    name = name or flag_name(f)
    t = _base_type(f)
    if value is None:
        if not _nullable(f):
            raise ConfigError(f"{name}: expected {t.__name__}, got None")
        return
    if several(f) and isinstance(value, list):
        if not value or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{name}: expected a string or a non-empty list of strings, got {value!r}")
        _check_pattern(f, value, name)
        return
    if t is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if t is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{name}: expected a list of strings, got {value!r}")
        _check_pattern(f, value, name)
        return
    if t is not Any and (not isinstance(value, t) or (t is not bool and isinstance(value, bool))):
        raise ConfigError(f"{name}: expected {t.__name__}, got {value!r}")   # YAML's true is not a number
    if t is float and value != value:
        raise ConfigError(f"{name}: expected a number, got nan")
    _check_pattern(f, [value], name)
    m = f.metadata
    if m.get("choices") and value not in m["choices"]:
        raise ConfigError(f"{name}: {value!r} is not one of {list(m['choices'])}")
    if m.get("ge") is not None and value < m["ge"]:
        raise ConfigError(f"{name}: {value} is below the minimum {m['ge']}")
    if m.get("le") is not None and value > m["le"]:
        raise ConfigError(f"{name}: {value} is above the maximum {m['le']}")


def validate(cfg) -> None:
    for sec, cls in sections(type(cfg)):
        section = getattr(cfg, sec)
        for f in options(cls):
            _check_field(f, getattr(section, f.name))


def _check_pattern(f: dataclasses.Field, items: list, name: str) -> None:
    """Every value (list item) of a setting that declares a ``pattern`` matches it, as the CRD asks at apply time:
    a pattern holds wherever the setting comes from (flags, YAML, a pool file)."""
    pattern = f.metadata["pattern"]
    for item in items if pattern is not None else []:
        if not matches_pattern(pattern, item):
            raise ConfigError(f"{name}: {item!r} is not {_PATTERN_MEANINGS.get(pattern, 'a match for ' + pattern)}")


def read_config_file(path: str) -> dict:
    """The settings of a ``--config`` YAML file (a mapping); a ConfigError naming the file where it cannot be read,
    is not YAML, or holds something else than a mapping."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, ValueError, RecursionError, yaml.YAMLError) as exc:   # ValueError: not UTF-8
        raise ConfigError(f"--config {path}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of settings at the top level, got "
                          f"{type(data).__name__}")
    return data


def merge_config_file(given: dict, data: dict, path: str, cfg_cls: type = NodeConfig) -> None:
    """Put a ``--config`` file's settings under the flags, as ``vllm serve --config``: ``given`` (the parsed flags,
    as ``from_args`` reads them) gains each setting the command line left out. A key is a setting's long flag name,
    with dashes or underscores (``max-model-len``, ``max_model_len``); one value for a list setting is one item. An
    unknown key, a setting given twice, or a value of the wrong type, choice or range is a ConfigError naming the
    file and the key."""
    fields = {f.name: (sec, f) for sec, f in all_options(cfg_cls)}
    from_file: set[str] = set()
    for key, value in data.items():
        name = key.replace("-", "_") if isinstance(key, str) else None
        if name not in fields:
            raise ConfigError(f"--config {path}: unknown setting {key!r}")
        if name in from_file:
            raise ConfigError(f"--config {path}: {key}: the setting is given twice")
        from_file.add(name)
        sec, f = fields[name]
        if isinstance(value, str) and _base_type(f) is list:
            value = [value]
        try:
            _check_field(f, value, key)
        except ConfigError as exc:
            raise ConfigError(f"--config {path}: {exc}") from None
        given.setdefault(f"{sec}.{name}", value)   # the command line wins
