"""The recipe schema: one frozen, validated dataclass per recipe section, and ``Recipe``.

Every field carries its documentation, allowed values and default in
``field(metadata=...)`` (built by ``omni.recipe_fields``).
"""
from collections.abc import Mapping
from dataclasses import dataclass, field, is_dataclass

from .recipe_fields import (
    _NAME,
    _NONEMPTY,
    _PORT,
    _POSITIVE,
    _REQUIRES_RULE,
    _SIZE_RULE,
    FrozenDict,
    RecipeError,
    _Rule,
    _apply,
    _at_least,
    _between,
    _field_of,
    _insert,
    _opt,
    _parse_float,
    _parse_validated,
    _pattern,
    _section,
    _Tree,
    _Validated,
    parse_bytes,
    parse_size,
    platform_choices,
)
from .model_registry import flavor_choices

TINY_FLAVOR = "hunyuan_image3_tiny"  # the default: the embedded checkpoint, runs without --model
DTYPES = ("float32", "bfloat16", "float16")
QUANT_SCHEMES = ("none", "fp8_tensor", "fp8_row", "mxfp8", "nvfp4", "w8a8")  # == omni.specs.QUANT_SCHEMES (tested)
ATTENTION_BACKENDS = ("auto", "sdpa", "varlen", "fa3", "flex", "fia", "aiter")
MEMORY_BOUND = ("auto", "triton", "torch")  # == omni.specs.MEMORY_BOUND (tested)
GROUPED_FP8 = ("auto", "torch", "cutlass", "deepgemm")  # == omni.specs.GROUPED_FP8 (tested)
GROUPED_SMALL_ROWS = 32  # == omni.specs.GROUPED_SMALL_ROWS (tested)
GROUPED_SKINNY_ROWS = 16  # == omni.specs.GROUPED_SKINNY_ROWS (tested)
SKINNY_ROWS = 64  # == omni.specs.SKINNY_ROWS (tested)
PDL_ROWS = 0  # == omni.specs.PDL_ROWS (tested)
GiB = 1 << 30


@dataclass(frozen=True, kw_only=True, slots=True)
class Device(_Validated):
    """The kind of device this deployment runs on, and how many of them."""

    kind: str = _opt("cpu", "device model the recipe was sized for, e.g. cpu, h200, h100, mi300x, a2, a3",
                     rule=_pattern(r"[a-z0-9][a-z0-9_-]*", "lowercase letters, digits, '_', '-'"))
    count: int = _opt(1, "devices used on one host; must equal parallel world size (one process per device)",
                      rule=_at_least(1))
    memory_gib: float = _opt(0.0, "minimum memory per device in GiB as the runtime reports it; 0 = not stated",
                             rule=_at_least(0), parse=_parse_float)
    memory_limit_gib: float = _opt(0.0, "cap on this process's device memory in GiB (a share of a card); allocations "
                                        "beyond it fail; 0 = no cap", rule=_at_least(0), parse=_parse_float)
    expandable_segments: bool = _opt(False, "the caching allocator grows its segments in place (torch's "
                                            "expandable_segments) instead of reserving new ones beside the "
                                            "cache; less memory held back from other processes, same speed "
                                            "where measured (BENCHMARKS.md)")

    def _rules(self) -> None:
        if self.memory_limit_gib and self.memory_gib and self.memory_limit_gib > self.memory_gib:
            raise RecipeError(f"must be <= device.memory_gib ({self.memory_gib:g}), got {self.memory_limit_gib:g}",
                              "memory_limit_gib")


@dataclass(frozen=True, kw_only=True, slots=True)
class Model(_Validated):
    """Which model, where its weights are, and in which precision it runs."""

    flavor: str = _opt(TINY_FLAVOR, "model flavor registered under omni.models (omni-run models lists them), "
                                    "or auto: read from the checkpoint's config.json", choices=flavor_choices)
    path: str | None = _opt(None, "Hugging Face-format directory with safetensors; null = embedded tiny weights "
                                  "(a released flavor then needs --model PATH)", rule=_NONEMPTY)
    dtype: str = _opt("bfloat16", "dtype of transformer weights and activations", choices=DTYPES)
    vae_dtype: str = _opt("float32", "dtype the VAE decodes (and encodes) in: float32, or an autocast dtype "
                                     "(float16 is the official pipeline's); the weights stay float32",
                          choices=DTYPES)


@dataclass(frozen=True, kw_only=True, slots=True)
class Parallel(_Validated):
    """Mesh degrees; world size = dp * cfg * ulysses * ring * tp, one process per device."""

    tp: int = _opt(1, "tensor parallel: attention heads and expert intermediate dims split over tp ranks",
                   rule=_at_least(1))
    ep: int = _opt(1, "expert parallel: experts spread over ep ranks (divides the world size)", rule=_at_least(1))
    ulysses: int = _opt(1, "sequence parallel, Ulysses all-to-all over image tokens", rule=_at_least(1))
    ring: int = _opt(1, "sequence parallel, ring attention (K/V rotation)", rule=_at_least(1))
    cfg: int = _opt(1, "guidance rows on separate rank groups: 1 (packed in one forward) or 2", choices=(1, 2))
    dp: int = _opt(1, "data parallel: independent replicas", rule=_at_least(1))

    @property
    def world_size(self) -> int:
        return self.dp * self.cfg * self.ulysses * self.ring * self.tp

    def _rules(self) -> None:
        if self.ep > self.world_size or self.world_size % self.ep:
            raise RecipeError(f"must divide the world size {self.world_size} (dp*cfg*ulysses*ring*tp), "
                              f"got {self.ep}", "ep")


@dataclass(frozen=True, kw_only=True, slots=True)
class Quant(_Validated):
    """Weight/activation quantization of linear layers."""

    scheme: str = _opt("none", "none; fp8_tensor / fp8_row (e4m3, per-tensor / per-row scale); mxfp8; nvfp4; "
                               "w8a8 (int8)", choices=QUANT_SCHEMES)
    experts_only: bool = _opt(False, "quantize only MoE expert weights; attention and dense layers keep model.dtype")


@dataclass(frozen=True, kw_only=True, slots=True)
class Attention(_Validated):
    """Preferred attention backend (a platform that cannot honour it refuses with a reason)."""

    backend: str = _opt("auto", "auto (the platform picks); sdpa; varlen (torch varlen); fa3 (FlashAttention-3); "
                                "flex (FlexAttention); fia (Ascend fused infer attention); aiter (AMD)",
                        choices=ATTENTION_BACKENDS)
    fp8: bool = _opt(False, "e4m3 queries, keys and values in the attention products (one dynamic scale each; "
                            "CUDA: FA3 on gathered KV; other backends refuse it); gated in docs/quality.md")


@dataclass(frozen=True, kw_only=True, slots=True)
class Kernels(_Validated):
    """Kernel choices of the platform (a demand the platform cannot meet is refused with a reason)."""

    memory_bound: str = _opt("auto", "memory-bound steps around the GEMMs (fp8 activation quantization, MoE gather, "
                                     "SwiGLU, combine, attention.fp8's q/k/v quantization): auto (Triton where the "
                                     "platform has it, else torch ops); triton (demand it: refused where absent); "
                                     "torch (plain torch ops)",
                             choices=MEMORY_BOUND)
    fp8_fast_accum: bool = _opt(False, "fp8 GEMMs may accumulate in the tensor cores without promoting partial sums "
                                       "to fp32 (Hopper fast accumulation): faster, less exact; platforms without "
                                       "it compute exactly; gated in docs/quality.md")
    grouped_fp8: str = _opt("auto", "kernel of the fp8 expert (grouped) GEMMs: auto (CUDA sm90: our CUTLASS build "
                                    "where nvcc and the nvidia-cutlass headers are found, compiled once into "
                                    "~/.cache/omni-run/kernels; else the stock kernel); torch (torch's "
                                    "_scaled_grouped_mm); cutlass (demand the CUTLASS build: refused where absent); "
                                    "deepgemm (CUDA sm90, fp8_row: the fused MoE on DeepGEMM's grouped kernel, "
                                    "the cuda-deepgemm extra; weights in 128x128 scale blocks, exact accumulation; "
                                    "refused where absent)",
                            choices=GROUPED_FP8)
    grouped_fp8_small_rows: int = _opt(GROUPED_SMALL_ROWS, "where at most this many rows reach each expert on "
                                       "average (text decode steps, short prompts), the fp8 expert GEMMs run a "
                                       "smaller-tile build where the platform has one (CUDA: 64-row tiles of the "
                                       "CUTLASS build, fast accumulation); 0 = never; the same numbers",
                                       rule=_at_least(0))
    grouped_fp8_skinny_rows: int = _opt(GROUPED_SKINNY_ROWS, "decode steps of at most this many tokens (no "
                                        "expert then gets more rows) run the fused MoE's fp8_row expert GEMMs on a "
                                        "kernel that spreads each expert's weight read over every SM where the "
                                        "platform has one (CUDA: Triton, with fp8_fast_accum, up to 16, in front "
                                        "of the CUTLASS builds); 0 = never; the same product, summed in another "
                                        "order", rule=_at_least(0))
    fp8_skinny_rows: int = _opt(SKINNY_ROWS, "dense fp8_row GEMMs of at most this many rows (decode steps, short "
                                "prompts) run a kernel that spreads the weight's read over every SM where the "
                                "platform has one (CUDA: Triton, with fp8_fast_accum, up to 64 rows); 0 = never; "
                                "the same product, summed in another order", rule=_at_least(0))
    pdl_rows: int = _opt(PDL_ROWS, "the platform's own kernels called on at most this many rows (a decode step's "
                         "tokens or routed rows) launch with programmatic dependent launch where the device has it "
                         "(CUDA sm90+: the launch no longer waits for the kernel before it; the kernel waits on the "
                         "device); 0 = never; the same numbers", rule=_at_least(0))
    shared_expert_stream: bool = _opt(False, "run each MoE layer's shared expert on a side stream beside the routed "
                                             "path (router, sort, gather, grouped GEMMs), joined at the combine; "
                                             "the same numbers; devices without streams (the CPU) run it inline")
    fuse_shared_expert: bool = _opt(False, "run each MoE layer's shared expert as the routed experts' last group "
                                           "(every token routed to it with weight 1): its two GEMMs and SwiGLU "
                                           "join the routed ones, fewer launches where a step has few tokens "
                                           "(text decode); needs parallel.ep 1 and quant.experts_only false; the "
                                           "same function, summed in another order")


@dataclass(frozen=True, kw_only=True, slots=True)
class KvCache(_Validated):
    """The per-worker KV pool holding each request's prefix K/V."""

    mode: str = _opt("paged", "paged (fixed pages, block tables) or contiguous (one slab per request row)",
                     choices=("paged", "contiguous"))
    budget_bytes: int = _opt(2 * GiB, "pool size per worker: integer bytes or a string like '16GiB', '512MiB'",
                             rule=_POSITIVE, parse=parse_bytes)
    page_tokens: int = _opt(256, "tokens per page when paged (platforms may require a multiple of 16 or more)",
                            rule=_at_least(1))


@dataclass(frozen=True, kw_only=True, slots=True)
class Offload(_Validated):
    """Weights kept in pinned host memory and streamed to the device."""

    mode: str = _opt("none", "none; layers (transformer layers streamed); experts (MoE experts streamed); "
                             "text (embeddings/LM head on host); vae (VAE on host until decode)",
                     choices=("none", "layers", "experts", "text", "vae"))
    resident_layers: int = _opt(0, "layers kept on the device permanently when streaming layers or experts",
                                rule=_at_least(0))
    prefetch_window: int = _opt(1, "layers fetched ahead on a side stream", rule=_at_least(1))


@dataclass(frozen=True, kw_only=True, slots=True)
class StepCache(_Validated):
    """TeaCache-style step skipping (off by default; measure quality before enabling)."""

    enabled: bool = _opt(False, "skip a step's transformer when its modulated input barely changed")
    threshold: float = _opt(0.1, "accumulated relative L1 change below which a step is skipped",
                            rule=_POSITIVE, parse=_parse_float)


@dataclass(frozen=True, kw_only=True, slots=True)
class Graph(_Validated):
    """Device-graph capture of the denoising step, and of the text decode steps where the model answers in text."""

    mode: str = _opt("eager", "eager, or capture (record per shape bucket and replay: denoising steps, text "
                              "decode steps and VAE decodes; needs platform support)",
                     choices=("eager", "capture"))


@dataclass(frozen=True, kw_only=True, slots=True)
class Vae(_Validated):
    """VAE decode tiling (tiles are spread across ranks)."""

    tiling: bool = _opt(False, "decode in overlapping latent tiles to bound memory")
    tile_latents: int = _opt(32, "tile side in latent pixels", rule=_at_least(1))
    overlap: int = _opt(8, "overlap between tiles in latent pixels, blended; < tile_latents", rule=_at_least(0))
    streams: int = _opt(1, "tiles decoded at once on this many device streams (each holds one tile's activations); "
                           "needs tiling", rule=_at_least(1))

    def _rules(self) -> None:
        if self.overlap >= self.tile_latents:
            raise RecipeError(f"must be < tile_latents ({self.tile_latents}), got {self.overlap}", "overlap")
        if self.streams > 1 and not self.tiling:
            raise RecipeError(f"vae.streams={self.streams} decodes tiles concurrently, but vae.tiling is false; "
                              "set vae.tiling: true or vae.streams: 1", "streams")


@dataclass(frozen=True, kw_only=True, slots=True)
class Serving(_Validated):
    """HTTP server limits (omni-run serve)."""

    host: str = _opt("127.0.0.1", "address to bind; 0.0.0.0 exposes the server to the network", rule=_NONEMPTY)
    port: int = _opt(8091, "TCP port to listen on", rule=_PORT)
    max_queue: int = _opt(64, "requests waiting beyond the running ones before 429 (0 = none wait)",
                          rule=_at_least(0))
    max_running: int = _opt(8, "requests denoising together (step-level batching)", rule=_at_least(1))
    max_batch_tokens: int = _opt(32768, "packed tokens per forward (all rows of all running requests)",
                                 rule=_at_least(1))
    text_tokens_per_image_step: int = _opt(4, "while images denoise, tokens each text answer gets per image "
                                              "step (1: one each, text waits for every image step)",
                                           rule=_at_least(1))
    request_timeout_s: float = _opt(600.0, "seconds before a request is cancelled", rule=_POSITIVE,
                                    parse=_parse_float)
    warmup_steps: int = _opt(2, "the server runs one default request of this many steps before it reports ready, "
                                "so JIT compiles and graph captures do not land on the first user's request "
                                "(0 = none)", rule=_at_least(0))
    compile_first: bool = _opt(False, "the warm-up first runs its requests once with the platform's just-in-time "
                                      "kernels compiled, not run (outputs dropped), so their compiles run together "
                                      "instead of one by one as the warm-up reaches them (omni/compile_pass.py); "
                                      "omni-run generate/edit/chat pass their own first request through it "
                                      "first, cut to warmup_steps steps; no effect where the platform compiles "
                                      "nothing at first launch (cpu)")
    api_key_env: str | None = _opt(None, "name of the environment variable holding the API key; null = no key",
                                   rule=_pattern(r"[A-Za-z_][A-Za-z0-9_]*", "an environment variable name"))
    max_image_pixels: int = _opt(4096 * 4096, "largest reference image (editing) in width x height pixels; a larger "
                                              "one is refused from its header, before it is decoded",
                                 rule=_at_least(16 * 16))
    png_compress_level: int = _opt(4, "zlib-style effort of PNG responses, 0-9: lossless at every level; lower "
                                      "encodes faster into more bytes (0 stores; 1-3 one fast ISA-L pass; 4-6 also "
                                      "try ISA-L's thorough level and zlib's run-length mode per row chunk, keeping "
                                      "the shortest; 7-9 also zlib at the level: omni/serving/png.py, "
                                      "BENCHMARKS.md)", rule=_between(0, 9))
    fetch_remote_images: bool = _opt(False, "let chat image_url parts name http(s) URLs the server fetches (timeout, "
                                            "byte limit); false = data: URIs only. True lets clients make the server "
                                            "request any URL it can reach")

    def _rules(self) -> None:
        if self.compile_first and not self.warmup_steps:
            raise RecipeError("true runs the warm-up's requests in a compile pass first, but serving.warmup_steps "
                              "is 0 (no warm-up); set warmup_steps >= 1 or compile_first: false", "compile_first")


_REPLICAS = _Rule(">= 1 or null", lambda v: v is None or v >= 1)


@dataclass(frozen=True, kw_only=True, slots=True)
class Ray(_Validated):
    """Replicas as Ray Serve deployments across hosts (omni-run serve --ray); unused otherwise."""

    min_replicas: int | None = _opt(None, "engine replicas Ray Serve keeps running, each one engine of "
                                          "world size / dp ranks on one host; null = parallel.dp", rule=_REPLICAS)
    max_replicas: int | None = _opt(None, "most engine replicas autoscaling may run; null = min_replicas "
                                          "(a fixed count, no autoscaling)", rule=_REPLICAS)
    target_ongoing_requests: int | None = _opt(None, "HTTP requests per replica autoscaling aims at; null = "
                                                     "serving.max_running", rule=_REPLICAS)
    ingress_replicas: int = _opt(1, "replicas of the ingress that forwards each request to an engine replica "
                                    "and retries it if that replica dies", rule=_at_least(1))
    retries: int = _opt(2, "times an accepted request is sent again when its replica dies before answering",
                        rule=_at_least(0))

    def _rules(self) -> None:
        if self.min_replicas and self.max_replicas and self.max_replicas < self.min_replicas:
            raise RecipeError(f"must be >= ray.min_replicas ({self.min_replicas}), got {self.max_replicas}",
                              "max_replicas")


@dataclass(frozen=True, kw_only=True, slots=True)
class Defaults(_Validated):
    """Generation parameters used when a request does not give them."""

    steps: int = _opt(50, "denoising steps", rule=_at_least(1))
    guidance: float = _opt(5.0, "classifier-free guidance scale s (v = v_uncond + s * (v_cond - v_uncond))",
                           rule=_at_least(0), parse=_parse_float)
    size: str = _opt("1024x1024", "image size WIDTHxHEIGHT", rule=_SIZE_RULE)
    shift: float = _opt(3.0, "flow-matching timestep shift", rule=_POSITIVE, parse=_parse_float)
    template: str = _opt("pretrain", "sequence template: pretrain (base model) or instruct (User:/Assistant:)",
                         choices=("pretrain", "instruct"))
    system_prompt: str | None = _opt(None, "text prepended as the system prompt; null = none")

    @property
    def width_height(self) -> tuple[int, int]:
        return parse_size(self.size)


@dataclass(frozen=True, kw_only=True, slots=True)
class Recipe(_Validated):
    """One deployment: model, device, layout, precision, caching, serving limits."""

    name: str = field(metadata={"doc": "recipe name, by convention the file stem <device>_<layout>",
                                "rule": _NAME})
    description: str = _opt("", "one line shown by omni-run recipes")
    platform: str = _opt("auto", "platform plugin: auto (the single accelerator found), cpu, cuda, rocm, npu, "
                                 "xpu, musa, or an installed third-party platform", choices=platform_choices)
    requires: str = _opt("", "platform package requirement, e.g. 'omni-run>=0.1'; '' = none",
                         rule=_REQUIRES_RULE)
    device: Device = _section(Device)
    model: Model = _section(Model)
    parallel: Parallel = _section(Parallel)
    quant: Quant = _section(Quant)
    attention: Attention = _section(Attention)
    kernels: Kernels = _section(Kernels)
    kv_cache: KvCache = _section(KvCache)
    offload: Offload = _section(Offload)
    step_cache: StepCache = _section(StepCache)
    graph: Graph = _section(Graph)
    vae: Vae = _section(Vae)
    serving: Serving = _section(Serving)
    ray: Ray = _section(Ray)
    defaults: Defaults = _section(Defaults)
    validated: tuple[FrozenDict, ...] = _opt((), "results on real hardware: a list of {date, hardware, commit, "
                                                 "<metric>: <value>} entries", parse=_parse_validated)

    def _rules(self) -> None:
        p = self.parallel
        if p.world_size != self.device.count:
            raise RecipeError(f"{self.device.count} device(s) but the parallel world size is {p.world_size} "
                              f"(dp {p.dp} * cfg {p.cfg} * ulysses {p.ulysses} * ring {p.ring} * tp {p.tp}); "
                              "they must be equal (one process per device)", "device.count")
        if self.quant.experts_only and self.quant.scheme == "none":
            raise RecipeError("true needs a quant.scheme other than none", "quant.experts_only")
        if self.kernels.fuse_shared_expert and (p.ep > 1 or self.quant.experts_only):
            why = (f"parallel.ep={p.ep} spreads the routed experts over ranks, while every rank needs the shared one"
                   if p.ep > 1 else "quant.experts_only keeps the shared expert in model.dtype, the routed ones fp8")
            raise RecipeError(f"true conflicts: {why}; set kernels.fuse_shared_expert: false",
                              "kernels.fuse_shared_expert")
        if self.offload.mode in ("layers", "experts", "vae") and self.graph.mode == "capture":
            raise RecipeError(f"offload.mode={self.offload.mode} conflicts with graph.mode=capture: streamed "
                              "weights move between device slots, which a captured graph cannot follow; "
                              "use graph.mode=eager or offload.mode=none|text", "offload.mode")

    def get_path(self, path: str) -> object:
        """The value at a dotted path such as ``"parallel.tp"``."""
        obj = self
        for part in path.split("."):
            if not is_dataclass(obj):
                raise RecipeError(f"not a section, so it has no key {part!r}", path)
            obj = getattr(obj, _field_of(obj, part, path).name)
        return obj

    def replace_path(self, path: str, value: object) -> "Recipe":
        """A new Recipe with one leaf changed (validated like YAML input: '2GiB' works)."""
        return self.replace_paths({path: value})

    def replace_paths(self, changes: Mapping[str, object]) -> "Recipe":
        """A new Recipe with several leaves changed at once, validated once at the end."""
        tree = _Tree()
        try:
            for path, value in changes.items():
                _insert(tree, path, value)
            return _apply(self, tree)
        except RecipeError as e:
            raise e.within(source=e.source or f"recipe {self.name}") from None
