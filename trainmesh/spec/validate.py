"""The one entry point for every rule a job spec keeps: ``problems(spec, layout)``.

The command line (``validate``, ``run``, ``submit``, ``evaluate``), ``run_job``, the controller
and every candidate the planner weighs call it, so that a layout the planner returns is never
refused when the same spec pins it, and a pinned layout that is refused is never returned.
Each rule's statement lives once, in ``spec/mesh_rules.py`` (what a mesh can split) or here
(rules between the spec's other fields); a :class:`Problem` names its field and the fix.

What needs the outside world is read by the caller and passed in as plain data: the datasets'
metadata (``datasets``), whether Triton kernels are interpreted on this machine. Pure: no IO.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from trainmesh.spec.mesh_rules import (
    DIVISIBILITY,
    ModelShape,
    consecutive_nodes,
    cp_problems,
    dp_problems,
    hsdp_problems,
    microbatches_per_replica,
    runnable_problems,
    shape_problems,
    stage_layers_problems,
    uneven_ep_nodes,
)
from trainmesh.spec.problems import Problem

# The byte tokenizer's vocabulary (``data/tokenizer.py``'s VOCAB_SIZE: 256 bytes + end of
# document; data/ imports nothing, so the spec states it and a test keeps the two equal).
BYTE_TOKENIZER_VOCAB = 257
INTERLEAVED = ("interleaved-1f1b", "zbv", "dualpipev")  # schedules running vpp > 1 chunks a rank
V_SHAPED = ("zbv", "dualpipev")  # ... two of them in a V (stages r and 2·pp−1−r on rank r)
SPLIT_BACKWARD = ("zb-h1", "zbv", "dualpipev")  # backwards split into I and W (some, DualPipeV)


class LayoutLike(Protocol):
    """A mesh layout: a pinned spec's (:class:`Layout`) or a planner candidate's."""

    tp: int
    pp: int
    dp: int
    cp: int
    ep: int
    vpp: int
    dp_replicate: int
    schedule: str
    sequence_parallel: bool
    microbatch_size: int
    stage_layers: tuple[int, ...] | None  # blocks of each pipeline stage (None: the even split)


@dataclass(frozen=True)
class Layout:
    """The degrees and per-layout choices a spec pins (``parallelism``, ``schedule.name``,
    ``training.microbatch_size``)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    vpp: int = 1
    dp_replicate: int = 1
    schedule: str = "1f1b"
    sequence_parallel: bool = False
    microbatch_size: int = 1
    stage_layers: tuple[int, ...] | None = None

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @classmethod
    def pinned(cls, spec) -> Layout | None:
        """The layout ``spec`` pins, or None under ``parallelism: auto``."""
        par = spec.parallelism
        if par.auto:
            return None
        return cls(par.tp, par.pp, par.dp, par.cp, par.ep, par.vpp, par.dp_replicate,
                   spec.schedule.name, par.sequence_parallel, spec.training.microbatch_size,
                   tuple(par.stage_layers) if par.stage_layers else None)


@dataclass(frozen=True)
class Workload:
    """What a layout has to split: the model's shape and the batch's geometry."""

    model: ModelShape
    global_batch_size: int
    seq_len: int
    document_mask: bool = False
    float8: str = "none"

    @classmethod
    def of(cls, spec) -> Workload:
        tr = spec.training
        return cls(spec.model, tr.global_batch_size, tr.seq_len, spec.data.document_mask, tr.float8)


def layout_problems(work: Workload, lay: LayoutLike, runnable: bool = True) -> list[Problem]:
    """Every rule layout ``lay`` breaks for ``work``; ``runnable``: also what this version does
    not build for a valid layout (``mesh_rules.runnable_problems``)."""
    m = work.model
    out = [*shape_problems(m, lay.tp, lay.pp, lay.vpp, lay.dp, lay.ep, lay.cp),
           *hsdp_problems(lay.dp, lay.dp_replicate, lay.ep, lay.cp),
           *cp_problems(work.seq_len, lay.cp, lay.tp, lay.ep, lay.pp,
                        lay.sequence_parallel or getattr(m, "moe", None) is not None,
                        work.document_mask),
           *dp_problems(work.global_batch_size, lay.microbatch_size, lay.dp, lay.pp)]
    if work.float8 != "none" and lay.tp > 1:
        out.append(Problem("training.float8", f"{work.float8} beside tensor parallel (tp={lay.tp}) "
                           "is not built", "set training.float8=none or parallelism.tp=1"))
    if getattr(m, "moe", None) is not None and lay.tp > 1 and work.seq_len % lay.tp:
        out.append(Problem("training.seq_len", f"{work.seq_len} is not divisible by tp={lay.tp} "
                           "(each tensor-parallel rank routes its share of a sequence to the "
                           "experts)", f"use a multiple of {lay.tp}"))
    if getattr(m, "dropout", 0.0) and (lay.cp > 1 or work.document_mask):
        out.append(Problem("model.dropout", f"{m.dropout}: attention dropout is not built for "
                           f"context parallel (cp={lay.cp}) or document masks (their attention "
                           "runs over the ring)", "set model.dropout=0, or parallelism.cp=1 and "
                           "data.document_mask=false"))
    if lay.vpp > 1 and lay.schedule not in INTERLEAVED:
        out.append(Problem("schedule.name", f"{lay.schedule} runs one model chunk per stage but "
                           f"parallelism.vpp={lay.vpp}", "use schedule.name=interleaved-1f1b (the "
                           "default when vpp > 1), zbv or dualpipev, or set vpp=1"))
    v = lay.schedule
    if v in V_SHAPED and lay.pp > 1 and lay.vpp != 2:
        out.append(Problem("parallelism.vpp", f"{v} places two chunks per rank in a V, but "
                           f"parallelism.vpp={lay.vpp}", "set parallelism.vpp=2"))
    if v in V_SHAPED and lay.pp > 1 and len(set(lay.stage_layers or [0])) > 1:
        out.append(Problem("parallelism.stage_layers", f"{v} with stages of unequal size "
                           f"({list(lay.stage_layers)}) is not built: its V places stages r and "
                           "2·pp−1−r on rank r", "give every stage the same count, or use "
                           "another schedule", DIVISIBILITY))
    elif v in V_SHAPED and lay.pp > 1 and m.n_layers % (lay.pp * lay.vpp):
        out.append(Problem("parallelism.pp", f"{v} with stages of unequal size (n_layers="
                           f"{m.n_layers} over pp × vpp = {lay.pp}×{lay.vpp}) is not built: its V "
                           "places stages r and 2·pp−1−r on rank r", "choose pp × vpp dividing "
                           "model.n_layers, or another schedule", DIVISIBILITY))
    if (v == "dualpipev" and lay.pp > 1 and not work.global_batch_size % lay.microbatch_size
            and lay.dp <= work.global_batch_size // lay.microbatch_size):
        share = microbatches_per_replica(work.global_batch_size, lay.microbatch_size, lay.dp)
        if share < 2 * lay.pp:
            need = 2 * lay.pp * lay.microbatch_size * lay.dp
            out.append(Problem("training.global_batch_size", f"dualpipev needs at least as many "
                               f"microbatches per data-parallel replica as stages (2·pp = "
                               f"{2 * lay.pp}), but {work.global_batch_size} / microbatch_size "
                               f"{lay.microbatch_size} over dp={lay.dp} gives {share}",
                               f"raise it to {need} or more, lower training.microbatch_size or "
                               "parallelism.dp, or use another schedule", DIVISIBILITY))
    if runnable:
        out += runnable_problems(m, lay.tp, lay.pp, lay.sequence_parallel)
        if getattr(m, "mtp", None) is not None:
            split = " × ".join(f"{n}={d}" for n, d in (("tp", lay.tp), ("cp", lay.cp)) if d > 1)
            if split and m.moe is not None and m.moe.capacity_factor is not None:
                out.append(Problem("model.moe.capacity_factor", "capacity beside model.mtp and "
                                   f"{split} is not built: a prediction module's positions "
                                   "split unevenly over those ranks, which the capacity's "
                                   "exchange does not take", "set model.moe.capacity_factor="
                                   "null (dropless), parallelism.tp=1 and parallelism.cp=1, "
                                   "or model.mtp=null"))

    return out


def field_problems(spec) -> list[Problem]:
    """Rules between the spec's fields that hold whatever the layout."""
    m, tr, el = spec.model, spec.training, spec.elastic
    out: list[Problem] = []

    def need(ok: bool, path: str, what: str, fix: str) -> None:
        if not ok:
            out.append(Problem(path, what, fix))

    gqa = m.mla is None  # (MLA's head sizes are its own, checked in MLAConfig)
    need(not gqa or m.head_dim is not None or m.dim % m.n_heads == 0, "model.dim",
         f"{m.dim} is not divisible by n_heads={m.n_heads}",
         "make dim a multiple of model.n_heads, or give model.head_dim")
    need(m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads",
         f"n_heads={m.n_heads} is not divisible by n_kv_heads={m.n_kv_heads}",
         f"use a divisor of {m.n_heads}")
    hd = m.head_dim or m.dim // m.n_heads
    need(not gqa or hd % 2 == 0, "model.head_dim" if m.head_dim else "model.dim",
         f"head dim {hd} is odd",
         "RoPE needs an even head dim: change model.dim or model.n_heads (or model.head_dim)")
    need(m.mtp is None or not spec.data.document_mask, "model.mtp",
         "multi-token prediction beside document masks is not built",
         "set data.document_mask=false, or model.mtp=null")
    split, par = spec.parallelism.stage_layers, spec.parallelism
    need(par.ep_dispatch != "relay" or not par.ep_overlap, "parallelism.ep_dispatch",
         "relay beside parallelism.ep_overlap is not built (the two hops run whole)",
         "set parallelism.ep_dispatch=auto (it relays without ep_overlap), or ep_overlap=false")
    need(split is None or sum(split) == m.n_layers, "parallelism.stage_layers",
         f"{split} holds {sum(split or [])} blocks, the model {m.n_layers}",
         f"give counts that add up to model.n_layers={m.n_layers}")
    if not par.auto:
        out += stage_layers_problems(split, par.pp, par.vpp)
    need(spec.data.path is not None or m.vocab_size >= BYTE_TOKENIZER_VOCAB, "model.vocab_size",
         f"{m.vocab_size} is smaller than the byte tokenizer's {BYTE_TOKENIZER_VOCAB} tokens",
         f"use at least {BYTE_TOKENIZER_VOCAB} (264 keeps it divisible by 8)")
    need(tr.seq_len <= m.max_seq_len, "training.seq_len",
         f"{tr.seq_len} exceeds model.max_seq_len={m.max_seq_len}",
         "shorten training.seq_len or raise model.max_seq_len")
    need(el.max_world_size is None or el.min_world_size <= el.max_world_size,
         "elastic.min_world_size", f"{el.min_world_size} exceeds max_world_size={el.max_world_size}",
         "make min_world_size ≤ max_world_size")
    need(spec.eval.every == 0 or bool(spec.data.eval_path or spec.data.eval_fraction), "eval.every",
         "evaluation needs held-out data", "set data.eval_path or data.eval_fraction, or eval.every=0")
    need(not (spec.data.eval_path and spec.data.eval_fraction), "data.eval_fraction",
         "is set beside data.eval_path", "hold out one way: drop one of them")
    need(spec.optimizer.warmup_steps <= tr.steps, "optimizer.warmup_steps",
         f"{spec.optimizer.warmup_steps} exceeds training.steps={tr.steps}",
         "shorten the warm-up or train longer")
    return out


def relay_problems(spec, dims, nodes: Sequence[int] | None = None) -> list[Problem]:
    """``parallelism.ep_dispatch: relay`` where an EP group's nodes hold unequal numbers of its
    ranks, on layout ``dims`` (its pp, dp, cp, tp, ep); ``nodes[g]``: global rank g's node
    (default: ``ep_node_ranks``' consecutive nodes)."""
    par = spec.parallelism
    if par.ep_dispatch != "relay" or dims.ep == 1:
        return []
    if nodes is None:
        if par.ep_node_ranks is None:
            return []  # (the placement's nodes: checked where the ranks are placed)
        nodes = consecutive_nodes(dims.pp * dims.dp * dims.cp * dims.tp, par.ep_node_ranks)
    held = uneven_ep_nodes(dims.pp, dims.dp, dims.cp, dims.tp, dims.ep, nodes)
    if held is None:
        return []
    return [Problem("parallelism.ep_dispatch", f"relay needs each node to hold as many ranks of "
                    f"an EP group, but one group's nodes hold {held} (ep={dims.ep}, tp={dims.tp}"
                    + (f", ep_node_ranks={par.ep_node_ranks})" if par.ep_node_ranks else ")"),
                    "set parallelism.ep_dispatch=auto (direct there), or nodes of a multiple "
                    "of an EP group's share (parallelism.ep_node_ranks)")]


def held_out_problems(spec) -> list[Problem]:
    """An evaluation (``trainmesh evaluate``) needs held-out data."""
    if spec.data.eval_path or spec.data.eval_fraction:
        return []
    return [Problem("data.eval_path", "no held-out data", "set data.eval_path or "
                    "data.eval_fraction (e.g. --set data.eval_fraction=0.05)")]


def world_problems(spec, world: int) -> list[Problem]:
    """A layout's world size against ``elastic``'s bounds."""
    el = spec.elastic
    out = []
    if world < el.min_world_size:
        out.append(Problem("elastic.min_world_size", f"{el.min_world_size} exceeds the planned "
                           f"world size {world}", f"lower it to at most {world}"))
    if el.max_world_size is not None and world > el.max_world_size:
        out.append(Problem("elastic.max_world_size", f"{el.max_world_size} is below the planned "
                           f"world size {world}", f"raise it to at least {world}"))
    return out


def kernel_problems(spec, triton_interpreted: bool) -> list[Problem]:
    """Triton kernels asked for where they cannot run (``triton_interpreted``: the caller's
    ``TRITON_INTERPRET=1``, under which they run on CPU, slowly)."""
    kernels = spec.model.kernels
    asked = kernels.values() if isinstance(kernels, dict) else [kernels]
    if "triton" in asked and spec.runtime.device == "cpu" and not triton_interpreted:
        return [Problem("model.kernels", "triton kernels need a CUDA device (runtime.device is "
                        "cpu)", "use model.kernels=auto, or TRITON_INTERPRET=1 to interpret "
                        "them on CPU (slow)")]
    return []


def dataset_problems(spec, datasets: Mapping[str, Any]) -> list[Problem]:
    """The datasets against the model: ``datasets`` maps ``path`` / ``eval_path`` to the
    dataset's metadata (``data.shards.read_meta``) or to the error reading it raised; the
    model's vocabulary must hold every id, the held-out data and an imported model's tokenizer
    (``tokenizer_sha256``: of ``model.init_from``'s tokenizer.json, when the caller read one)
    be the training data's."""
    out, metas = [], {}
    for field in ("path", "eval_path"):
        if field not in datasets:
            continue
        path, meta = getattr(spec.data, field), datasets[field]
        if isinstance(meta, BaseException):
            what = str(meta).removeprefix(f"data.path {path}: ").split("; prepare it")[0]
            again = "again " if isinstance(meta, ValueError) else ""
            out.append(Problem(f"data.{field}", f"{path}: {what}", f"prepare it {again}with "
                               f"`trainmesh data prepare INPUTS --out {path}`"))
            continue
        metas[field] = meta
        if meta["vocab_size"] > spec.model.vocab_size:
            out.append(Problem("model.vocab_size", f"{spec.model.vocab_size} is smaller than the "
                               f"{meta['vocab_size']} tokens of the dataset at {path} "
                               f"(tokenizer: {_tokenizer_name(meta['tokenizer'])})",
                               f"use at least {meta['vocab_size']}, or a dataset made with a "
                               "smaller tokenizer"))
    train = metas.get("path", {}).get("tokenizer", {"kind": "byte"} if not spec.data.path else None)
    if train and "eval_path" in metas and _tokenizer_id(metas["eval_path"]["tokenizer"]) != _tokenizer_id(train):
        out.append(Problem("data.eval_path", f"made with tokenizer "
                           f"{_tokenizer_name(metas['eval_path']['tokenizer'])}, the training data "
                           f"with {_tokenizer_name(train)}", "prepare both with the same --tokenizer"))
    model_tok = datasets.get("tokenizer_sha256")
    if train and model_tok is not None and model_tok != train.get("sha256"):
        out.append(Problem("data.path", f"made with tokenizer {_tokenizer_name(train)}, not "
                           f"model.init_from's {spec.model.init_from}/tokenizer.json",
                           f"prepare the data with --tokenizer {spec.model.init_from}"))
    return out


def _tokenizer_id(tok: dict[str, Any]) -> str:
    return tok.get("sha256", tok["kind"])


def _tokenizer_name(tok: dict[str, Any]) -> str:
    return tok.get("source", tok["kind"])


def problems(spec, layout: LayoutLike | None = None, *, runnable: bool = False,
             datasets: Mapping[str, Any] | None = None,
             triton_interpreted: bool | None = None) -> list[Problem]:
    """Every problem with ``spec`` run at ``layout`` (default: the layout it pins; none under
    ``parallelism: auto``, whose batch is then checked at dp = 1). ``runnable``: also what this
    version does not build or run (``trainmesh run`` refuses it; ``validate`` accepts it, so
    reference specs for larger layouts stay checkable). ``datasets``: the datasets' metadata as
    the caller read it (``dataset_problems``); ``triton_interpreted``: whether the ranks run
    under ``TRITON_INTERPRET=1`` (``kernel_problems``; None: the caller cannot tell)."""
    out = field_problems(spec)
    lay = layout if layout is not None else Layout.pinned(spec)
    if lay is None:
        out += dp_problems(spec.training.global_batch_size, spec.training.microbatch_size, 1, 1)
    else:
        out += layout_problems(Workload.of(spec), lay, runnable)
        out += world_problems(spec, lay.tp * lay.pp * lay.dp * lay.cp)
        out += relay_problems(spec, lay)
    if runnable and triton_interpreted is not None:
        out += kernel_problems(spec, triton_interpreted)
    if datasets is not None:
        out += dataset_problems(spec, datasets)
    return out
