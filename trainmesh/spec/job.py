"""The job spec: one pydantic model per section, ``extra="forbid"`` everywhere.

A spec is plain data. It never reads the environment and never holds runtime objects;
the runner resolves defaults that depend on the job (``runtime.output_dir``) explicitly.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from trainmesh.spec.kernel_choice import kernel_problems
from trainmesh.spec.presets import PRESETS

SPEC_ENV = "TRAINMESH_SPEC"  # the variable `trainmesh submit` and `k8s render` put a spec in


def _steps_or_auto(v: Any) -> Any:
    if v == "auto":
        return v
    if isinstance(v, bool) or not isinstance(v, int | str) or not str(v).isdigit():
        raise ValueError(f"{v!r} is not a number of steps; give a whole number ≥ 0 (0: only at "
                         "the end) or auto")
    return int(v)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RopeScaling(_Section):
    """Long-context RoPE (Hugging Face's ``rope_scaling`` / ``rope_parameters``). ``llama3``
    (Llama 3.1): wavelengths longer than ``original_max_position_embeddings /
    low_freq_factor`` are stretched by ``factor``, those shorter than ``... / high_freq_factor``
    kept, the ones between interpolated smoothly. ``yarn`` (DeepSeek-V3): frequencies of fewer
    than ``beta_slow`` turns over the original context divided by ``factor``, of more than
    ``beta_fast`` kept, a linear ramp between; the softmax scale grows with ``mscale_all_dim``."""

    type: Literal["llama3", "yarn"] = Field("llama3", description="the scaling rule: llama3 "
                                            "(Llama 3.1's) or yarn (DeepSeek-V3's)")
    factor: float = Field(gt=0, description="how much longer wavelengths are stretched")
    low_freq_factor: float = Field(1.0, gt=0, description="llama3: wavelengths above original "
                                   "/ this are stretched by factor")
    high_freq_factor: float = Field(4.0, gt=0, description="llama3: wavelengths below original "
                                    "/ this are kept; those between are blended")
    original_max_position_embeddings: int = Field(8192, ge=1, description="the context length "
                                                  "the model was pre-trained at")
    beta_fast: float = Field(32.0, gt=0, description="yarn: dimensions turning more than this "
                             "many times over the original context keep their frequency")
    beta_slow: float = Field(1.0, gt=0, description="yarn: dimensions turning fewer times are "
                             "divided by factor; those between ramp linearly")
    mscale: float = Field(1.0, ge=0, description="yarn: the cos/sin tables are scaled by "
                          "(0.1·mscale·ln factor + 1) / (0.1·mscale_all_dim·ln factor + 1) where "
                          "both mscales are given, else by 0.1·ln factor + 1")
    mscale_all_dim: float = Field(0.0, ge=0, description="yarn: the softmax scale is multiplied "
                                  "by (0.1·mscale_all_dim·ln factor + 1)²; 0: not")

    @model_validator(mode="after")
    def _ordered(self) -> RopeScaling:
        if self.type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"high_freq_factor ({self.high_freq_factor}) must exceed "
                             f"low_freq_factor ({self.low_freq_factor})")
        if self.type == "yarn" and self.beta_fast < self.beta_slow:
            raise ValueError(f"beta_fast ({self.beta_fast}) is below beta_slow ({self.beta_slow}); "
                             "give beta_fast ≥ beta_slow")
        return self


class MoEConfig(_Section):
    """Mixture of Experts in place of the SwiGLU MLP (after ``dense_layers`` dense blocks):
    token-choice top-k routing, dropless unless ``capacity_factor`` is set."""

    experts: int = Field(ge=2, description="routed experts per MoE block")
    top_k: int = Field(2, ge=1, description="experts each token is routed to")
    expert_ffn_dim: int = Field(ge=8, description="SwiGLU hidden size of one expert")
    shared_experts: int = Field(0, ge=0, description="always-active experts (one SwiGLU of "
                                "shared_experts × expert_ffn_dim) beside the routed ones")
    router: Literal["softmax", "sigmoid"] = Field(
        "softmax", description="router scores: softmax over experts (Mixtral, Qwen3-MoE) or a "
        "per-expert sigmoid (DeepSeek-V3)")
    normalize_top_k: bool = Field(True, description="divide the chosen experts' scores by their "
                                  "sum (Mixtral: yes; Qwen3-MoE: its norm_topk_prob)")
    balance: Literal["aux_loss", "bias"] = Field(
        "aux_loss", description="aux_loss: the Switch load-balancing loss × aux_loss_coef; bias: "
        "DeepSeek-V3's aux-loss-free balancing, a per-expert bias added to the scores for "
        "choosing (not weighting) experts, moved by bias_update_rate after each step")
    aux_loss_coef: float = Field(0.01, ge=0, description="with balance: aux_loss, the balancing "
                                 "loss's weight (Switch Transformer's)")
    bias_update_rate: float = Field(1e-3, ge=0, description="with balance: bias, how far each "
                                    "expert's routing bias moves per step towards an even load")
    dense_layers: int = Field(0, ge=0, description="leading blocks that keep the dense MLP")
    n_group: int = Field(1, ge=1, description="group-limited routing (DeepSeek-V3): the experts "
                         "in n_group equal groups, each scored by its two best (biased) scores; "
                         "1: no groups")
    topk_group: int = Field(1, ge=1, description="with n_group > 1, a token's experts are chosen "
                            "from its topk_group best groups only (where groups map onto nodes, "
                            "its all-to-all reaches at most that many)")
    routed_scaling_factor: float = Field(1.0, gt=0, description="the routed experts' weights "
                                         "(after normalize_top_k) are multiplied by this "
                                         "(DeepSeek-V3: 2.5)")
    capacity_factor: float | None = Field(
        None, gt=0, description="null: dropless; a number: each expert takes at most "
        "ceil(capacity_factor × tokens × top_k / experts) assignments of a microbatch, dropping "
        "those with the lowest routing weights (ties: the later token; counted and logged), "
        "decided over the whole microbatch on any mesh (tensor and context parallel ranks that "
        "split its tokens all-gather its assignments)")

    @model_validator(mode="after")
    def _fits(self) -> MoEConfig:
        if self.top_k > self.experts:
            raise ValueError(f"top_k={self.top_k} exceeds experts={self.experts}; choose at "
                             "most that many")
        if self.experts % self.n_group:
            raise ValueError(f"n_group={self.n_group} does not divide experts={self.experts}; "
                             "use a divisor of experts (1: no groups)")
        if self.n_group > 1 and self.experts // self.n_group < 2:
            raise ValueError(f"n_group={self.n_group} leaves one expert a group (a group scores "
                             "by its two best experts); use at most experts / 2 groups")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group={self.topk_group} exceeds n_group={self.n_group}; "
                             "use at most n_group")
        if self.n_group > 1 and self.top_k > self.topk_group * (self.experts // self.n_group):
            raise ValueError(f"top_k={self.top_k} exceeds the experts of topk_group="
                             f"{self.topk_group} groups ({self.topk_group * (self.experts // self.n_group)}"
                             "); raise topk_group or lower top_k")
        return self


class MTPConfig(_Section):
    """DeepSeek-V3's multi-token prediction: after the model, ``depth`` modules in a chain, the
    k-th predicting the token k + 1 ahead of each position from the previous module's hidden
    state (the model's, normalised, for the first) and the embedding of the token k ahead,
    through one more block of the model's kind; the embedding and the output head are the
    model's own."""

    depth: int = Field(1, ge=1, description="prediction modules (DeepSeek-V3: 1)")
    loss_weight: float = Field(0.3, gt=0, description="the modules' losses are averaged and "
                               "added × this to the next-token loss (DeepSeek-V3: 0.3, then "
                               "0.1); the logged loss stays the next-token one, the modules' as "
                               "mtp_loss")


class MLAConfig(_Section):
    """Multi-head Latent Attention (DeepSeek-V2/V3): queries through a low-rank projection,
    keys and values through one compressed latent expanded per head, and a rotary key shared
    by every head beside each head's unrotated part."""

    q_lora_rank: int | None = Field(None, ge=1, description="the query's low-rank projection "
                                    "size (with its RMSNorm); null: a full projection "
                                    "(DeepSeek-V2-Lite)")
    kv_lora_rank: int = Field(ge=1, description="the compressed key/value latent's size (with "
                              "its RMSNorm)")
    qk_nope_head_dim: int = Field(ge=1, description="each head's query/key dimensions without "
                                  "RoPE")
    qk_rope_head_dim: int = Field(ge=2, description="the rotary dimensions: of each query head, "
                                  "and of the one key shared across heads; even")
    v_head_dim: int = Field(ge=1, description="each head's value size (may differ from the "
                            "query/key head's, qk_nope_head_dim + qk_rope_head_dim)")

    @model_validator(mode="after")
    def _even(self) -> MLAConfig:
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} is odd; RoPE rotates "
                             "pairs of dimensions: use an even number")
        return self


class ModelConfig(_Section):
    """Llama-style decoder shape. A preset fills every shape field not given explicitly."""

    preset: Literal[tuple(PRESETS)] | None = Field(  # type: ignore[valid-type]
        "tiny", description="a named shape (trainmesh/spec/presets.py) filling every shape field "
        "not given; null: give them all")
    dim: int = Field(0, ge=8, description="hidden size")
    n_layers: int = Field(0, ge=1, description="transformer blocks")
    n_heads: int = Field(0, ge=1, description="attention (query) heads")
    n_kv_heads: int = Field(0, ge=1, description="key/value heads (GQA); n_heads when equal")
    ffn_dim: int = Field(0, ge=8, description="SwiGLU hidden size")
    vocab_size: int = Field(0, ge=2, description="embedding rows; at least the tokenizer's")
    max_seq_len: int = Field(0, ge=8, description="longest sequence RoPE is built for")
    head_dim: int | None = Field(None, ge=2, description="per-head size; null: dim / n_heads")
    qk_norm: bool = Field(False, description="RMSNorm over each query and key head before RoPE "
                          "(Qwen3)")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout while training, on the "
                           "attention probabilities and on each block's attention and MLP output "
                           "before the residual add (HF Llama's attention_dropout, plus residual); "
                           "0: none. Each rank's random streams are checkpointed")
    norm_eps: float = Field(1e-5, gt=0, description="RMSNorm's epsilon")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE's base wavelength")
    rope_scaling: RopeScaling | None = Field(None, description="Llama 3.1 RoPE scaling; none: plain")
    tie_embeddings: bool = Field(False, description="the output head shares the token "
                                 "embedding's weight")
    moe: MoEConfig | None = Field(None, description="Mixture of Experts blocks; null: dense")
    mtp: MTPConfig | None = Field(None, description="multi-token prediction modules after "
                                  "the model (DeepSeek-V3); null: none")
    mla: MLAConfig | None = Field(None, description="Multi-head Latent Attention in place of "
                                  "grouped-query attention (DeepSeek-V2/V3; n_kv_heads and "
                                  "head_dim then unused); null: GQA")
    init_from: str | None = Field(
        None, description="a Hugging Face directory (config.json, safetensors: Llama, Qwen3, "
        "Mixtral, Qwen3-MoE or DeepSeek-V3) to start from; each rank reads only its slices. "
        "Shape fields not given come from its config.json")
    kernels: Literal["auto", "triton", "torch"] | dict[str, Literal["triton", "torch"]] = Field(
        "auto", description="fused ops (rms_norm, swiglu, rope, linear_cross_entropy): Triton "
        "kernels or the torch references, for every op or per op (a mapping; ops not named: "
        "auto); auto: what the GPU check kit measured fastest on this GPU, else torch")

    compile: bool = Field(False, description="torch.compile each transformer block (regional, "
                          "in place: parameter names unchanged), after tensor parallel and "
                          "activation checkpointing, before ZeRO-3")

    @field_validator("kernels")
    @classmethod
    def _known_ops(cls, v: Any) -> Any:
        broken = kernel_problems(v)
        if broken:
            raise ValueError(broken[0])
        return v

    @model_validator(mode="before")
    @classmethod
    def _fill_from_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        name = data.get("preset", "tiny")
        if name is None or name not in PRESETS:
            return data  # field validation reports an unknown preset
        preset = PRESETS[name]  # a nested value given in part keeps the preset's other keys
        return {**preset, **data, **{k: {**preset[k], **data[k]} for k in data
                                      if isinstance(preset.get(k), dict) and isinstance(data[k], dict)}}

    @model_validator(mode="after")
    def _shape_given(self) -> ModelConfig:
        missing = [f for f in ("dim", "n_layers", "n_heads", "ffn_dim", "vocab_size",
                               "max_seq_len") if getattr(self, f) == 0]
        if missing:
            raise ValueError(f"without a preset these fields are required: {', '.join(missing)}"
                             "; set model.preset (e.g. tiny) or give them all")
        if self.n_kv_heads == 0:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.mla is not None and self.qk_norm:
            raise ValueError("qk_norm=true beside mla: MLA normalises its latents, not each "
                             "head; set model.qk_norm=false")
        if self.mla is not None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.moe is not None and self.moe.dense_layers > self.n_layers:
            raise ValueError(f"moe.dense_layers={self.moe.dense_layers} exceeds n_layers="
                             f"{self.n_layers}; use at most n_layers")
        return self


class DataConfig(_Section):
    """A token dataset made by ``trainmesh data prepare`` (its ``dataset.json`` names the
    tokenizer); ``path: null`` uses the bundled tiny corpus."""

    path: str | None = Field(None, description="dataset directory: a local path or an fsspec URI")
    eval_path: str | None = Field(None, description="a held-out dataset (same tokenizer)")
    eval_fraction: float = Field(0.0, ge=0, lt=1, description="without eval_path: hold out this "
                                 "fraction of data.path's samples (the last ones; never trained on)")
    document_mask: bool = Field(False, description="packed documents: attention never crosses "
                                "a document boundary (the dataset's end-of-document token); "
                                "with or without context parallel, not beside pipeline parallel")


class EvalConfig(_Section):
    """Held-out loss over a fixed set of windows (``data.eval_path`` or ``data.eval_fraction``),
    logged to MLflow as ``eval_loss`` and to summary.json."""

    every: int = Field(0, ge=0, description="evaluate every N steps (0: only after the last "
                       "step, when held-out data is given)")
    batches: int = Field(4, ge=1, description="held-out batches of training.global_batch_size "
                         "windows each")


class ParallelismConfig(_Section):
    """Parallel degrees. ``parallelism: auto`` (or ``auto: true``) lets the planner choose."""

    auto: bool = Field(False, description="the planner chooses every degree for the cluster "
                       "(also written `parallelism: auto`)")
    tp: int = Field(1, ge=1, description="tensor-parallel degree (inside a node)")
    pp: int = Field(1, ge=1, description="pipeline stages")
    dp: int = Field(1, ge=1, description="data-parallel replicas (ZeRO-3 over this axis)")
    dp_replicate: int = Field(
        1, ge=1, description="hybrid sharding (HSDP): ZeRO-3 inside groups of dp / dp_replicate "
        "replicas, gradients all-reduced across the dp_replicate groups (divides dp; 1: ZeRO-3 "
        "over all of dp; = dp: no sharding, DDP's all-reduce overlapped with backward, for a "
        "dense model without tp, pp or cp whose whole state fits each rank; beside ep > 1 each "
        "group's replicas a multiple of ep / cp)")
    vpp: int = Field(1, ge=1, description="virtual pipeline chunks per stage (interleaving)")
    stage_layers: list[Annotated[int, Field(ge=1)]] | None = Field(
        None, description="the blocks of each of the pp × vpp pipeline stages (model chunks), "
        "in model order, e.g. [3, 4, 4, 3]; null: an even split, or where pp × vpp does not "
        "divide n_layers the extra blocks on the stages between the first (embedding) and the "
        "last (head and loss). Used while pp × vpp is its length (a re-plan to other degrees "
        "splits evenly)")
    ep: int = Field(1, ge=1, description="expert-parallel degree: each group of ep data-parallel "
                    "ranks splits the experts among them (needs model.moe; divides dp)")
    ep_overlap: bool = Field(
        False, description="with ep > 1: each MoE block takes a microbatch's tokens in two "
        "halves, one half's all-to-all running while the other's experts compute (forward "
        "and backward; the shared expert beside the last exchange back); equal to the whole "
        "exchange within float32's rounding; exposed stay the first exchange out and the last "
        "back, and backward's last out (the step's breakdown: a2a_s); no effect at ep 1. The "
        "planner prices it and `trainmesh plan` says what it would hide, but does not turn it "
        "on: not yet measured on GPUs")
    ep_dispatch: Literal["auto", "direct", "relay"] = Field(
        "auto", description="with ep > 1, how tokens reach their experts: direct (each of a "
        "token's top-k copies sent straight to its expert's rank) or relay (two hops, as "
        "DeepSeek-V3's: a token crosses once to each node holding its experts, to the rank there "
        "with its own local index, which hands it on inside the node and sums the outputs of "
        "that node's experts before the one row goes back; the bytes between nodes fall from "
        "top_k to the nodes reached, at most moe.topk_group where moe.n_group groups map onto "
        "nodes; refused beside ep_overlap and where a node would hold more of an EP group's "
        "ranks than another); auto: the planner's choice, relay where an EP group spans nodes "
        "holding as many of its ranks each, top_k > 1, ep_overlap is off and the relay is "
        "priced faster, else direct")
    ep_node_ranks: int | None = Field(
        None, ge=1, description="the ranks one node (one fast-link domain) holds, for "
        "ep_dispatch: consecutive ranks share a node; null: the nodes the ranks' actors run "
        "on. Set it where the fast domain is not a Ray node "
        "(an NVL72 rack of several nodes), or to simulate nodes on one machine")
    cp: int = Field(1, ge=1, description="context-parallel degree: each sequence split over cp "
                    "ranks (2·cp chunks, load-balanced), attention exact across them; "
                    "training.seq_len must divide by 2·cp")
    cp_mode: Literal["ring", "allgather"] = Field(
        "ring", description="context parallel: ring (key/value blocks passed round the ring, "
        "each transfer overlapped with a block's attention) or allgather (all-gather the keys "
        "and values, then attend locally: cp× their memory, one collective)")
    cp_latent: bool = Field(
        True, description="context parallel with Multi-head Latent Attention (model.mla): move "
        "each token's compressed latent and rotary key (kv_lora_rank + qk_rope_head_dim "
        "values) and expand them by wkv_b where they are attended, or (false) move the "
        "expanded keys and values (heads × 2 × the wider head), as split-backward schedules "
        "(zb-h1, zbv, dualpipev) always do: their weight pass would run the ring's backward "
        "again; and so does training.float8 (its wkv_b is a float8 linear); no effect on "
        "other attention")
    sequence_parallel: bool = Field(False, description="with tp > 1: norms, dropout and the "
                                    "residual stream split over the sequence between tp's "
                                    "regions (Megatron's sequence parallel)")
    keep_gathered: bool | None = Field(
        None, description="ZeRO-3: keep each rank's parameters gathered (and gradients "
        "unsharded) across a step's microbatches, reduce-scattering once (less traffic, more "
        "memory), or re-gather and reduce-scatter every microbatch; null: the planner chooses")
    reduce_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="dtype of the gradient reduction: ZeRO-3's reduce-scatter, or "
        "DDP's all-reduce (dp_replicate = dp)")

    @model_validator(mode="before")
    @classmethod
    def _auto_string(cls, data: Any) -> Any:
        return {"auto": True} if data == "auto" else data

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp


class ActivationCheckpointConfig(_Section):
    """Recompute blocks in backward to save memory: ``full`` every block, ``selective`` every
    ``stride``-th block, ``none`` keeps all activations."""

    mode: Literal["none", "full", "selective"] = Field(
        "none", description="full: every block's activations recomputed in backward; "
        "selective: every stride-th block's; none: all kept")
    stride: int = Field(2, ge=1, description="with selective: checkpoint every N-th block")


class ScheduleConfig(_Section):
    """Pipeline schedule used when ``parallelism.pp > 1``."""

    name: Literal["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev"] = Field(
        "1f1b", description="zb-h1 / zbv: zero-bubble schedules (backward split into input and "
        "weight gradients; zbv places parallelism.vpp=2 chunks per rank in a V); dualpipev: "
        "DeepSeek's DualPipeV (vpp=2 chunks in a V, a forward paired with another microbatch's "
        "backward, the drain's backwards split; at least 2·pp microbatches per data-parallel "
        "replica)")
    pair_overlap: bool = Field(
        True, description="dualpipev with MoE over ep > 1: each pair's forward and backward take "
        "turns on two threads, each handing over to the other where it waits on an expert "
        "all-to-all it started, so that one's exchanges are in flight while the other computes "
        "(false: the forward, then the backward; other schedules have no pairs)")


class OptimizerConfig(_Section):
    """AdamW with linear warm-up, cosine decay to ``min_lr_ratio * lr``, and grad clipping."""

    lr: float = Field(3e-3, gt=0, description="peak learning rate (after the warm-up)")
    weight_decay: float = Field(0.1, ge=0, description="AdamW's decoupled weight decay")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW's first-moment decay")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW's second-moment decay")
    eps: float = Field(1e-8, gt=0, description="AdamW's epsilon")
    warmup_steps: int = Field(10, ge=0, description="steps of linear warm-up to lr (step k of N "
                              "at lr·(k+1)/N)")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="the cosine decay's floor, as a "
                                "fraction of lr, which it reaches at training.steps")
    grad_clip: float = Field(1.0, ge=0, description="max global grad norm; 0 disables")


class TrainingConfig(_Section):
    """Steps and batch geometry: the global batch's global_batch_size / microbatch_size
    microbatches are dealt out to the dp replicas (shares differ by at most one)."""

    steps: int = Field(100, ge=1, description="optimizer steps the run trains in all")
    global_batch_size: int = Field(8, ge=1, description="sequences per optimizer step")
    microbatch_size: int = Field(2, ge=1, description="sequences per forward/backward")
    seq_len: int = Field(64, ge=2, description="tokens per training window")
    seed: int = Field(0, ge=0, description="seeds the initialisation, the data order and every "
                      "rank's random streams")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="compute dtype (bfloat16: mixed precision — ZeRO-3's bfloat16 "
        "compute copies, or autocast under DDP; the parameters and optimizer state stay float32, "
        "gradients reduced in parallelism.reduce_dtype)")
    float8: Literal["none", "tensorwise", "rowwise"] = Field(
        "none", description="float8 matmuls for the blocks' linear layers (torchao): one scale "
        "per tensor (with ZeRO-3's all-gather in float8) or per row; needs a GPU of compute "
        "capability 8.9+ (H100); on CPU torchao's emulation (tests); not beside tensor "
        "parallel. MoE experts run torchao's float8 grouped GEMMs under either recipe: rowwise "
        "scales on Hopper (9.x), MXFP8 on B200/B300 (10.x, where torchao's SM100 kernels are "
        "installed; not yet run) and, emulated, on CPU; elsewhere, or where their widths do "
        "not divide by the kernels' tiles, they stay in the compute dtype")


class InMemoryConfig(_Section):
    """Snapshots in host memory, each rank's copied to a rank on another node: a single
    node's loss restores from the survivors' memory (onto the re-planned mesh) instead of
    storage, losing at most the step in flight. Storage checkpoints stay the durable record."""

    every: int = Field(0, ge=0, description="snapshot every N steps (0: off)")


class CheckpointConfig(_Section):
    """Sharded Distributed Checkpoints under ``DIR/step-NNNNNN/`` (DIR: ``OUTPUT/checkpoints``
    unless ``dir`` says otherwise)."""

    dir: str | None = Field(None, description="a local path or an fsspec URI (s3://bucket/run, "
                            "gs://..., file:///mnt/ckpt; the filesystem's package must be "
                            "installed); every rank and the controller must reach it")
    every: Annotated[int | Literal["auto"], BeforeValidator(_steps_or_auto)] = Field(
        0, description="save every N steps (0: only at the end), or auto: the Young/Daly "
        "interval from the measured save cost and elastic.mtbf_node_hours, re-chosen when the "
        "mesh changes")
    async_save: bool = Field(False, description="write in the background: a step's shards are "
                             "copied to host memory, training goes on while a thread writes "
                             "them, and the manifest is committed once every rank is done")
    resume: Literal["auto", "never"] = Field(
        "auto", description="auto: start from the newest verified checkpoint in dir; never: "
        "from the initialisation (a dir holding an earlier run's checkpoints is refused); "
        "recoveries always restore the run's own newest")
    keep_last: int = Field(3, ge=1, description="verified checkpoints kept (older ones deleted "
                           "once newer ones verify)")
    save_final: bool = Field(True, description="save after the last step")
    in_memory: InMemoryConfig = Field(
        InMemoryConfig(), description="snapshots in host memory, each copied to a buddy rank on "
        "another node: what a recovery restores first")


class ElasticConfig(_Section):
    """Bounds on the world size the job may run at, and how often it may restart."""

    min_world_size: int = Field(1, ge=1, description="fewest ranks the job goes on with after "
                                "a failure (below it: the job fails)")
    max_world_size: int | None = Field(None, ge=1, description="most ranks the job grows to "
                                       "(null: every accelerator it is given)")
    max_restarts: int = Field(3, ge=0, description="recoveries from failures the job may make "
                              "in all (a resize or a preemption notice spends none)")
    hang_timeout_s: float | None = Field(
        None, gt=0, description="a step running longer than this has its stalled ranks (silent, "
        "or furthest behind while none moves) treated as hung: their nodes are dropped and the "
        "job recovers; default: 10 × the median of recent steps, at least 60 s. In a build, a "
        "restore, a save or an evaluation (one long phase), a rank silent for half of this "
        "(default 60 s; at most half the collective timeout) once it has passed is hung")
    mtbf_node_hours: float = Field(
        6300.0, gt=0, description="mean hours between interruptions of one node, for "
        "checkpoint.every: auto; default from Llama 3's 419 in 54 days on 2,048 8-GPU nodes")
    warm_recovery: bool = Field(True, description="after a failure, keep the surviving rank "
                                "actors (new process group, new model part) instead of "
                                "restarting every rank; falls back to a cold restart")
    ready_ranks_per_node: int | None = Field(
        None, ge=0, description="rank processes kept started on every node of the job's ranks "
        "and on as many spare nodes as replace one of them, torch and the parallel stack "
        "imported, holding no accelerator: a refill, a new node's ranks or a cold restart "
        "take one instead of starting a process. "
        "Default: on accelerator nodes, the ranks the plan puts on one node (a node replaced or "
        "every rank restarted starts no process; each costs ~0.4 GB of host memory and no "
        "accelerator), on CPU-only clusters of several nodes 1 (a lost rank process), on one CPU "
        "machine none (its cores are the ranks'); 0: none")


class TrackingConfig(_Section):
    """MLflow. ``uri: null`` means ``MLFLOW_TRACKING_URI`` if set, else sqlite in OUTPUT."""

    enabled: bool = Field(True, description="track the run in MLflow")
    uri: str | None = Field(None, description="MLflow tracking URI; null: MLFLOW_TRACKING_URI, "
                            "else sqlite under the output directory")
    experiment: str = Field("trainmesh", description="MLflow experiment name")
    backlog_in_memory: int = Field(
        10_000, ge=1, description="metric values kept in memory while the tracking server is "
        "unreachable; later ones spill to OUTPUT/mlflow-backlog-RUN_ID.jsonl and are replayed "
        "from it, in order, when the server is back")


class TopologyConfig(_Section):
    """What the planner assumes about the accelerators; every field overrides the device table
    (``trainmesh/planning/devices.py``) when set."""

    device: Literal["h100", "h200", "a100-40gb", "a100-80gb", "b200", "l40s", "cpu"] | None = Field(
        None, description="device kind; default: from Ray's accelerator label (CPU: cpu)")
    memory_gib: float | None = Field(None, gt=0, description="accelerator memory per device")
    peak_tflops: float | None = Field(None, gt=0, description="dense bf16 peak per device")
    intra_node_gbps: float | None = Field(None, gt=0, description="bandwidth between devices "
                                          "of a node, GB/s per device (NVLink)")
    inter_node_gbps: float | None = Field(None, gt=0, description="bandwidth between nodes, "
                                          "GB/s per device (InfiniBand, RoCE)")

    host_memory_gib: float | None = Field(
        None, gt=0, description="host memory per node (default: what Ray reports); bounds "
        "checkpoint.in_memory's snapshots")

    def overrides(self) -> dict[str, float | None]:
        return {k: getattr(self, k) for k in ("memory_gib", "peak_tflops", "intra_node_gbps",
                                              "inter_node_gbps")}


class RuntimeConfig(_Section):
    """Where and how the job runs."""

    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: each rank's GPU where Ray gave it one, else the CPU")
    ray_address: str = Field("local", description="'local' starts a Ray on this machine; "
                             "host:port, auto or ray://… joins a running cluster. A program "
                             "already connected to Ray (its own ray.init) runs there, and a "
                             "host:port naming another cluster is refused")
    output_dir: str | None = Field(None, description="default: runs/<job name>")
    collective_timeout_s: float = Field(120.0, gt=0, description="how long a collective (and "
                                        "forming a group) may wait for a peer")
    cpus_per_rank: float = Field(1.0, gt=0, description="Ray CPUs reserved per rank (and its "
                                 "torch threads)")
    gc_every: int = Field(
        50, ge=0, description="collect Python's garbage on every rank at the same steps: the "
        "young generations every N steps, everything every 10 × N and after each restore, "
        "save and evaluation, the automatic collector off while training (a rank's own "
        "collection would stall every other rank in the next collective); 0: Python's "
        "automatic collection. (Either way a rank's imports are frozen out of collections.)")


class JobSpec(_Section):
    """A whole job."""

    name: str = Field("job", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$",
                      description="the job's name: its output directory runs/NAME and MLflow "
                      "run name")
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    eval: EvalConfig = EvalConfig()
    parallelism: ParallelismConfig = ParallelismConfig()
    activation_checkpoint: ActivationCheckpointConfig = ActivationCheckpointConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    training: TrainingConfig = TrainingConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    elastic: ElasticConfig = ElasticConfig()
    tracking: TrackingConfig = TrackingConfig()
    topology: TopologyConfig = TopologyConfig()
    runtime: RuntimeConfig = RuntimeConfig()

    def resolved_output_dir(self) -> str:
        return self.runtime.output_dir or f"runs/{self.name}"
