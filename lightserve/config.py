"""ServerConfig: every setting of one launch, built once from the CLI and handed to every process.

`cli.parse_args` derives the CLI from the dataclass fields, so the dataclass is the single source of
truth. LightLLM's flag spellings (`--max_total_token_num`) are accepted along with dashed aliases.
"""
from __future__ import annotations

import json
import os
import secrets
import tempfile
from dataclasses import dataclass, field
from enum import Enum

from lightserve.chat.reasoning_parsers import REASONING_PARSERS
from lightserve.chat.tool_parsers import AUTO, TOOL_PARSERS
from lightserve.model_config import ModelConfig
from lightserve.sampling import MAX_TOP_LOGPROBS

SHM_PREFIX = "lightserve-"
# Default longest request (prompt + output) when --max_req_total_len is not given, capped by the model's
# context. Not the model's maximum (131,072 for Llama-3.1): per-slot state scales with it (the worker's
# req_to_token table, the decode graphs' attention length, the shm pool's token and top-logprob rows:
# 512 slots x 131,072 x 5 alternatives is 3 GB of /dev/shm). vLLM's paged KV makes a long max_model_len
# free until used, yet users serving Llama-3.1 on one GPU commonly set --max-model-len 8192-32768;
# LightLLM asks for the flag explicitly. 16,384 holds ordinary chat and RAG prompts; raise it per launch.
DEFAULT_MAX_REQ_TOTAL_LEN = 16384


class Device(str, Enum):
    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


class DType(str, Enum):
    AUTO = "auto"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class QuantActivations(str, Enum):
    """--quant_activations: how weights kept in GGML blocks (GGUF) multiply the activations (kernels/quant_linear.py)."""
    FLOAT32 = "float32"  # weight-only: float32 activations, the product with the dequantized weights
    INT8 = "int8"        # llama.cpp's: activations quantized to int8 per 32 values, integer dot products


class KVCacheDType(str, Enum):
    """--kv_cache_dtype: how the KV cache stores K and V (kernels/kv_store.py has the 8-bit formats)."""
    AUTO = "auto"            # the activation dtype
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    INT8 = "int8"            # symmetric, a scale per token and KV head
    FP8_E4M3 = "fp8_e4m3"    # a scale per tensor (the checkpoint's k_scale / v_scale, else 1.0)
    FP8_E5M2 = "fp8_e5m2"

    @classmethod
    def _missing_(cls, value: object) -> KVCacheDType | None:
        # vLLM's spellings: `fp8` is e4m3 there, as `fp8_e4m3` is.
        return {"fp8": cls.FP8_E4M3}.get(value) if isinstance(value, str) else None


class KernelBackend(str, Enum):
    """--kernel_backend: which kernels a forward runs (kernels/backend.py)."""
    AUTO = "auto"      # triton on CUDA, cpu on CPU
    TRITON = "triton"  # the GPU code path; on CPU under Triton's interpreter
    CPU = "cpu"        # the C kernels of kernels/cpu/


class SpeculativeAlgorithm(str, Enum):
    """--speculative_algorithm: who proposes the draft tokens the target model verifies (router/speculation.py)."""
    NONE = "none"
    NGRAM = "ngram"   # prompt lookup over the request's own prompt and output
    DRAFT = "draft"   # a smaller model of the same tokenizer, run by the workers (model_infer/draft_model.py)
    MTP = "mtp"       # DeepSeek-V3's multi-token-prediction layer, run by the workers (model_infer/mtp_drafter.py)


# Draft tokens a request may carry per step: every one is a KV row and a logits row [vocab] float32 on rank 0.
MAX_SPECULATIVE_TOKENS = 16
# The largest --max_lora_rank: every resident slot holds rank-padded A and B of each targeted projection.
MAX_LORA_RANK = 512
# vLLM's --speculative-config keys and the flags they set.
_SPECULATIVE_CONFIG_KEYS = {"method": "speculative_algorithm", "num_speculative_tokens": "num_speculative_tokens",
                            "prompt_lookup_max": "prompt_lookup_max", "prompt_lookup_min": "prompt_lookup_min",
                            "model": "speculative_draft_model_dir"}


class AdmissionPolicy(str, Enum):
    OPTIMISTIC = "optimistic"      # admit on estimated need; pause if the estimate proves wrong
    CONSERVATIVE = "conservative"  # reserve the full max_new_tokens; never pause


def _new_instance_id() -> str:
    # The launcher's pid leads the id so a later start can tell stale segments (dead pid) apart.
    return f"{os.getpid()}-{secrets.token_hex(3)}"


@dataclass(frozen=True)
class ServerConfig:
    """Every setting of one server launch. Built once by cli.parse_args, pickled to each process."""

    model_dir: str | None = field(default=None, metadata={"help": "HF model folder, or a .gguf file (or a folder holding one; served quantized on CPU); default: the bundled SmolLM2-135M-Instruct"})
    host: str = field(default="127.0.0.1", metadata={"help": "address the HTTP front binds"})
    port: int = field(default=8000, metadata={"help": "HTTP port"})
    tp: int = field(default=1, metadata={"help": "tensor-parallel ranks (model worker processes)"})
    nnodes: int = field(default=1, metadata={"help": "machines the tensor-parallel group spans"})
    node_rank: int = field(default=0, metadata={"help": "this machine's index among --nnodes"})
    nccl_host: str = field(default="127.0.0.1", metadata={"help": "rendezvous host of the TP group (node 0)"})
    nccl_port: int = field(default=0, metadata={"help": "rendezvous port of the TP group; 0 = pick a free one (single node only)"})
    max_total_token_num: int | None = field(default=None, metadata={"help": "KV cache size in tokens; default: sized from free memory"})
    max_req_total_len: int | None = field(default=None, metadata={"help": f"max prompt + output tokens of one request; default: {DEFAULT_MAX_REQ_TOTAL_LEN} or the model's context length if shorter"})
    running_max_req_size: int = field(default=256, metadata={"help": "max requests running at once"})
    batch_max_tokens: int | None = field(default=None, metadata={"help": "max new tokens computed in one step; default 512 on CPU, 8192 on GPU"})
    chunked_prefill_size: int | None = field(default=None, metadata={"help": "max prompt tokens of one request per step; default batch_max_tokens"})
    prefill_join_tokens: int | None = field(default=None, metadata={"help": "a step takes in another prompt only while its prompt tokens are below this (one prompt chunk may still fill --batch_max_tokens); default 128 on CPU, batch_max_tokens on GPU"})
    req_pool_size: int = field(default=512, metadata={"help": "shared-memory request slots (requests admitted to the engine at once)"})
    max_queue_size: int = field(default=1024, metadata={"help": "requests waiting for a request slot before 503"})
    request_timeout_s: float | None = field(default=None, metadata={"help": "abort a request after this many seconds"})
    shutdown_grace_s: float = field(default=30.0, metadata={"help": "on SIGTERM/Ctrl-C, seconds in-flight requests may run on before they are aborted"})
    health_generate_timeout_s: float = field(default=10.0, metadata={"help": "/health_generate answers 503 when no token comes back within this many seconds"})
    disable_prompt_cache: bool = field(default=False, metadata={"help": "turn the radix prefix cache off"})
    disable_overlap_schedule: bool = field(default=False, metadata={"help": "plan each step only after the one before has finished, never while it runs (tp > 1 always does)"})
    overlap_max_step_ms: float = field(default=20.0, metadata={"help": "with tp 1 the router plans a step while the one before runs when the step before that took less than this (short steps, where the router's time between steps counts; after longer ones a request arriving meanwhile would join a step later)"})
    speculative_algorithm: SpeculativeAlgorithm = field(default=SpeculativeAlgorithm.NONE, metadata={"help": "speculative decoding: ngram = prompt lookup over each request's prompt and output, verified by the model (greedy requests: the same tokens; sampling requests: speculative sampling, the same distribution); draft = a smaller model of the same tokenizer (--speculative_draft_model_dir) proposes each request's drafts greedily; mtp = DeepSeek-V3's multi-token-prediction layer does, from the model's own hidden states"})
    num_speculative_tokens: int = field(default=4, metadata={"help": f"draft tokens per request and step, 1..{MAX_SPECULATIVE_TOKENS}"})
    prompt_lookup_max: int = field(default=4, metadata={"help": "ngram: longest n-gram looked up"})
    prompt_lookup_min: int = field(default=2, metadata={"help": "ngram: shortest n-gram looked up"})
    speculative_draft_model_dir: str | None = field(default=None, metadata={"help": "draft: the draft model, an HF folder or a .gguf file of the served model's vocabulary and tokenizer; it runs on every worker rank over every step's tokens, with a KV cache of its own indexed by the same rows"})
    speculative_config: str | None = field(default=None, metadata={"help": "vLLM's spelling, JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}, or {\"method\": \"draft_model\", \"model\": PATH, \"num_speculative_tokens\": 4}; sets the flags above"})
    enable_lora: bool = field(default=False, metadata={"help": "serve LoRA adapters over the base model: a request names one in `model`; requests of different adapters (and of the base) share each step"})
    lora_modules: tuple[str, ...] | None = field(default=None, metadata={"nargs": "+", "help": "adapters served from the start, each NAME=PATH (a PEFT folder: adapter_config.json + adapter_model.safetensors); needs --enable_lora"})
    max_loras: int = field(default=1, metadata={"help": "adapters resident in the kernels' buffers at once (requests of others wait for a free slot)"})
    max_lora_rank: int = field(default=16, metadata={"help": "largest adapter rank accepted (every slot is sized for it)"})
    max_cpu_loras: int | None = field(default=None, metadata={"help": "adapters kept in each worker's CPU cache (least recently used dropped first); default --max_loras"})
    allow_runtime_lora_updating: bool = field(default=False, metadata={"help": "accept POST /v1/load_lora_adapter and /v1/unload_lora_adapter"})
    lora_dtype: DType = field(default=DType.AUTO, metadata={"help": "how the resident adapters' stacked A and B are stored (products summed in float32 whatever it is): auto = the activation dtype, but bfloat16 over quantized weights (GGUF, int8/int4) on CPU; bfloat16 halves the bytes a decode step reads for them (batch-1 latency with an adapter on CPU)"})
    admission_policy: AdmissionPolicy = field(default=AdmissionPolicy.OPTIMISTIC, metadata={"help": "how requests are admitted against free KV"})
    data_type: DType = field(default=DType.AUTO, metadata={"help": "weights/activations dtype; auto = bfloat16 on CUDA or CPUs with native bf16, float32 for weights kept quantized on CPU"})
    kv_cache_dtype: KVCacheDType = field(default=KVCacheDType.AUTO, metadata={"help": "KV cache storage: auto = the activation dtype; int8 (a scale per token and head) and fp8_e4m3 / fp8_e5m2 (fp8 = e4m3; the checkpoint's k_scale / v_scale, else 1.0) hold about twice the tokens and halve the bytes a decode step reads"})
    quant_activations: QuantActivations = field(default=QuantActivations.FLOAT32, metadata={"help": "GGUF weights kept in GGML blocks only: float32 = weight-only (float32 activations times the dequantized weights; token-exact against transformers on those weights); int8 = llama.cpp-style int8 activations (per 32 values, a float scale) and integer dot products at every batch size: faster decode and prefill, not token-exact"})
    device: Device = field(default=Device.AUTO, metadata={"help": "auto picks cuda when available"})
    kernel_backend: KernelBackend = field(default=KernelBackend.AUTO, metadata={"help": "auto = triton on CUDA, the C kernels on CPU; triton on CPU runs the GPU code path in Triton's interpreter (slow: for tests)"})
    disable_cudagraph: bool = field(default=False, metadata={"help": "run decode without CUDA graphs"})
    graph_max_batch_size: int = field(default=256, metadata={"help": "largest decode batch captured in a CUDA graph"})
    api_key: str | None = field(default=None, metadata={"help": "require 'Authorization: Bearer KEY' on every route but /health"})
    max_body_bytes: int = field(default=8 * 1024 * 1024, metadata={"help": "largest accepted HTTP request body"})
    max_n: int = field(default=16, metadata={"help": "largest n / best_of per request"})
    max_top_logprobs: int = field(default=5, metadata={"help": "largest top_logprobs per token (shm holds req_pool_size x max_req_total_len x this x 8 bytes, backed only where written)"})
    served_model_name: tuple[str, ...] | None = field(default=None, metadata={"nargs": "+", "help": "model name(s) in the OpenAI API, the first one reported, any one accepted; default: the folder name"})
    chat_template: str | None = field(default=None, metadata={"help": "a Jinja chat template file that overrides the model's"})
    generation_config: str = field(default="auto", metadata={"help": "default sampling params: 'auto' = the model's generation_config.json, 'vllm' = none (the server's defaults), or a folder holding a generation_config.json"})
    tool_call_parser: str = field(default=AUTO, metadata={"help": f"how tool calls are read from the output (tool_choice auto): {', '.join(TOOL_PARSERS)}, or auto (the format the chat template or model family speaks, logged at start)"})
    reasoning_parser: str | None = field(default=None, metadata={"help": f"split reasoning into reasoning_content: {', '.join(REASONING_PARSERS)}"})
    log_level: str = field(default="info", metadata={"help": "debug, info, warning, error"})
    start_timeout_s: float = field(default=600.0, metadata={"help": "seconds each child may take to report ready"})
    instance_id: str = field(default_factory=_new_instance_id, metadata={"help": "unique id of this launch (names shm and sockets)"})
    # Resolved at start (resolve_config.resolve_config, then EngineProcs.start), never flags: the model's facts,
    # read once from config.json, and the KV size every worker rank could allocate. For a GGUF model, model_dir
    # resolves to its HF metadata folder (model_prep.prepare_gguf, which links the file) and gguf_file to the file.
    model: ModelConfig | None = field(default=None, metadata={"cli": False})
    gguf_file: str | None = field(default=None, metadata={"cli": False})
    draft_model: ModelConfig | None = field(default=None, metadata={"cli": False})    # --speculative_algorithm draft
    draft_gguf_file: str | None = field(default=None, metadata={"cli": False})
    kv_size: int | None = field(default=None, metadata={"cli": False})
    kv_bytes_per_token: int | None = field(default=None, metadata={"cli": False})  # of a worker rank's cache

    def __post_init__(self) -> None:
        def need(cond: bool, flag: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"--{flag} {msg}")

        need(self.tp >= 1, "tp", f"must be >= 1, got {self.tp}")
        need(self.nnodes >= 1, "nnodes", f"must be >= 1, got {self.nnodes}")
        need(0 <= self.node_rank < self.nnodes, "node_rank", f"must be in [0, nnodes), got {self.node_rank}")
        need(self.tp % self.nnodes == 0, "tp", f"({self.tp}) must be a multiple of --nnodes ({self.nnodes})")
        need(1 <= self.port <= 65535, "port", f"must be in 1..65535, got {self.port}")
        need(self.max_total_token_num is None or self.max_total_token_num > 0, "max_total_token_num", "must be > 0")
        need(self.max_req_total_len is None or self.max_req_total_len > 1, "max_req_total_len", "must be > 1")
        need(self.running_max_req_size >= 1, "running_max_req_size", "must be >= 1")
        need(self.batch_max_tokens is None or self.batch_max_tokens >= 1, "batch_max_tokens", "must be >= 1")
        need(self.chunked_prefill_size is None or self.chunked_prefill_size >= 1, "chunked_prefill_size", "must be >= 1")
        need(self.prefill_join_tokens is None or self.prefill_join_tokens >= 1, "prefill_join_tokens", "must be >= 1")
        need(self.req_pool_size >= 1, "req_pool_size", "must be >= 1")
        need(self.max_queue_size >= 0, "max_queue_size", "must be >= 0")
        need(self.shutdown_grace_s >= 0, "shutdown_grace_s", f"must be >= 0, got {self.shutdown_grace_s}")
        need(self.health_generate_timeout_s > 0, "health_generate_timeout_s",
             f"must be > 0, got {self.health_generate_timeout_s}")
        need(0 <= self.max_top_logprobs <= MAX_TOP_LOGPROBS, "max_top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}]")
        if isinstance(self.served_model_name, str):  # one name given in code rather than on the CLI
            object.__setattr__(self, "served_model_name", (self.served_model_name,))
        need(self.served_model_name is None or len(self.served_model_name) >= 1, "served_model_name", "needs a name")
        need(self.chat_template is None or os.path.isfile(self.chat_template), "chat_template",
             f"{self.chat_template!r} is not a file")
        need(self.generation_config in ("auto", "vllm") or os.path.isdir(self.generation_config), "generation_config",
             f"must be auto, vllm or a folder, got {self.generation_config!r}")
        need(self.tool_call_parser == AUTO or self.tool_call_parser in TOOL_PARSERS, "tool_call_parser",
             f"must be {AUTO} or one of {sorted(TOOL_PARSERS)}")
        need(self.reasoning_parser is None or self.reasoning_parser in REASONING_PARSERS, "reasoning_parser",
             f"must be one of {sorted(REASONING_PARSERS)}")
        need(self.max_loras >= 1, "max_loras", f"must be >= 1, got {self.max_loras}")
        need(1 <= self.max_lora_rank <= MAX_LORA_RANK, "max_lora_rank", f"must be in [1, {MAX_LORA_RANK}], got {self.max_lora_rank}")
        need(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras, "max_cpu_loras",
             f"must be >= --max_loras ({self.max_loras}), got {self.max_cpu_loras}")
        need(self.enable_lora or not self.lora_modules, "lora_modules", "needs --enable_lora")
        need(self.enable_lora or not self.allow_runtime_lora_updating, "allow_runtime_lora_updating", "needs --enable_lora")
        if not isinstance(self.lora_dtype, DType):  # a string given in code rather than on the CLI
            try:
                object.__setattr__(self, "lora_dtype", DType(self.lora_dtype))
            except ValueError:
                raise ValueError(f"--lora_dtype must be one of {[d.value for d in DType]}, got {self.lora_dtype!r}") from None
        if isinstance(self.lora_modules, str):
            object.__setattr__(self, "lora_modules", (self.lora_modules,))
        for spec in self.lora_modules or ():
            name, sep, path = spec.partition("=")
            need(bool(sep and name.strip() and path.strip()), "lora_modules", f"takes NAME=PATH, got {spec!r}")
        self._apply_speculative_config()
        drafts = self.speculative_algorithm is SpeculativeAlgorithm.DRAFT
        need(not drafts or self.speculative_draft_model_dir is not None, "speculative_draft_model_dir",
             "must name the draft model with --speculative_algorithm draft")
        need(drafts or self.speculative_draft_model_dir is None, "speculative_draft_model_dir",
             "needs --speculative_algorithm draft")
        need(1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS, "num_speculative_tokens",
             f"must be in [1, {MAX_SPECULATIVE_TOKENS}], got {self.num_speculative_tokens}")
        need(1 <= self.prompt_lookup_min <= self.prompt_lookup_max, "prompt_lookup_min",
             f"must be in [1, --prompt_lookup_max ({self.prompt_lookup_max})], got {self.prompt_lookup_min}")
        need(self.log_level.lower() in ("debug", "info", "warning", "error"), "log_level", f"unknown level {self.log_level!r}")

    def _apply_speculative_config(self) -> None:
        """--speculative_config (vLLM's JSON) onto the speculative flags; ValueError naming the flag and the key."""
        if self.speculative_config is None:
            return
        try:
            spec = json.loads(self.speculative_config)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative_config is not JSON: {exc}") from None
        if not isinstance(spec, dict):
            raise ValueError("--speculative_config must be a JSON object")
        for key, value in spec.items():
            name = _SPECULATIVE_CONFIG_KEYS.get(key)
            if name is None:
                raise ValueError(f"--speculative_config: unknown key {key!r} (known: {sorted(_SPECULATIVE_CONFIG_KEYS)})")
            if name == "speculative_algorithm":
                try:
                    value = SpeculativeAlgorithm("draft" if value == "draft_model" else value)
                except ValueError:
                    raise ValueError(f"--speculative_config: unknown method {value!r} (known: "
                                     f"{[a.value for a in SpeculativeAlgorithm if a is not SpeculativeAlgorithm.NONE]})") from None
            elif name == "speculative_draft_model_dir":
                if not isinstance(value, str):
                    raise ValueError(f"--speculative_config: model must be a path, got {value!r}")
            elif not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"--speculative_config: {key} must be an integer, got {value!r}")
            object.__setattr__(self, name, value)

    @property
    def lora_items(self) -> tuple[tuple[str, str], ...]:
        """--lora_modules as (name, path) pairs, in order: the adapter ids 1, 2, ... the front and router agree on."""
        return tuple((name.strip(), path.strip()) for name, _, path in (m.partition("=") for m in self.lora_modules or ()))

    @property
    def lora_paths(self) -> tuple[str, ...]:
        return tuple(path for _, path in self.lora_items)

    @property
    def speculates(self) -> bool:
        return self.speculative_algorithm is not SpeculativeAlgorithm.NONE

    # ---- the model's facts, once resolved ----
    @property
    def model_config(self) -> ModelConfig:
        assert self.model is not None, "ServerConfig not resolved (resolve_config.resolve_config)"
        return self.model

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.model_config.eos_token_ids

    # ---- derived names: unique per launch so two servers (or two tests) never collide ----
    @property
    def shm_name(self) -> str:
        return f"{SHM_PREFIX}{self.instance_id}-reqs"

    def ipc_addr(self, name: str) -> str:
        return f"ipc://{tempfile.gettempdir()}/{SHM_PREFIX}{self.instance_id}-{name}"

    @property
    def router_addr(self) -> str:  # front and detokenizer PUSH -> router PULL
        return self.ipc_addr("router")

    @property
    def detok_addr(self) -> str:  # rank 0 and router PUSH -> detokenizer PULL
        return self.ipc_addr("detok")

    @property
    def front_addr(self) -> str:  # detokenizer PUSH -> HTTP front PULL
        return self.ipc_addr("front")

    @property
    def step_done_addr(self) -> str:  # rank 0 PUSH -> router PULL
        return self.ipc_addr("stepdone")

    def plan_addr(self, tp_rank: int) -> str:
        """Router (binds, on node 0) PUSH -> worker (connects) PULL. With several nodes the plans
        travel over tcp on the ports after --nccl_port."""
        if self.nnodes == 1:
            return self.ipc_addr(f"plan{tp_rank}")
        return f"tcp://{self.nccl_host}:{self.nccl_port + 1 + tp_rank}"

    def plan_bind_addr(self, tp_rank: int) -> str:
        if self.nnodes == 1:
            return self.plan_addr(tp_rank)
        return f"tcp://*:{self.nccl_port + 1 + tp_rank}"

    @property
    def ranks_per_node(self) -> int:
        return self.tp // self.nnodes

    @property
    def is_master_node(self) -> bool:
        return self.node_rank == 0

