"""What a mesh can run: the one statement of each rule that ties the model's shape and the batch
to the parallel degrees (tp, pp and vpp, dp and hybrid sharding, cp, ep), each with one message
naming the field and the fix. ``spec.validate.layout_problems`` applies them all to a layout
(for a pinned spec and for every planner candidate alike); the planner also prunes its search
with single rules (``Problem.kind`` and the message are its reason), and the parallelizers
check them before they split a model.

Two families:
- ``shape_problems``: a layout that cannot exist (a degree that does not divide what it splits);
  ``trainmesh validate`` refuses it.
- ``runnable_problems``: a layout this version does not build (a tied head split over tp or pp,
  sequence parallel without tp); ``validate`` accepts it so reference specs for larger
  layouts stay checkable, ``trainmesh run`` and the planner refuse it.
Pure: plain integers in, problems out."""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Sequence
from typing import Protocol

from trainmesh.spec.problems import Problem

DIVISIBILITY, TIED = "divisibility", "tied embeddings"


class ModelShape(Protocol):
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    tie_embeddings: bool
    # optional ``moe``: a MoEConfig (experts, capacity_factor, …) or None


def valid_tp_degrees(n_heads: int, n_kv_heads: int) -> list[int]:
    """The tensor-parallel degrees that split both the query and the key/value heads."""
    return [d for d in range(1, n_kv_heads + 1) if n_heads % d == 0 and n_kv_heads % d == 0]


def tp_problems(m: ModelShape, tp: int) -> list[Problem]:
    """tp splits the heads (query and key/value alike) and the vocabulary (the vocab-parallel
    embedding and output)."""
    out = []
    if m.n_heads % tp or m.n_kv_heads % tp:
        out.append(Problem("parallelism.tp", f"tp={tp} does not divide n_heads={m.n_heads} and "
                           f"n_kv_heads={m.n_kv_heads}",
                           f"use one of {valid_tp_degrees(m.n_heads, m.n_kv_heads)}", DIVISIBILITY))
    if m.vocab_size % tp:
        out.append(Problem("parallelism.tp", f"tp={tp} does not divide model.vocab_size="
                           f"{m.vocab_size} (the embedding and the output are split over tp by "
                           "vocabulary)", f"pad model.vocab_size to a multiple of {tp} (a model's "
                           "vocabulary may exceed its data's), or use another tp", DIVISIBILITY))
    return out


def pp_problems(m: ModelShape, pp: int, vpp: int) -> list[Problem]:
    """pp × vpp model chunks share the layers (unevenly where they do not divide them:
    ``model_math.stage_split``), each at least one; vpp > 1 needs stages to interleave."""
    out = []
    if m.n_layers < pp * vpp:
        out.append(Problem("parallelism.pp", f"pp × vpp = {pp}×{vpp} stages exceed "
                           f"n_layers={m.n_layers} (each stage holds a block at least)",
                           f"choose pp × vpp ≤ {m.n_layers}", DIVISIBILITY))
    if vpp > 1 and pp == 1:
        out.append(Problem("parallelism.vpp", "vpp > 1 needs pp > 1",
                           "set parallelism.vpp=1 or parallelism.pp>1", DIVISIBILITY))
    return out


def stage_layers_problems(split, pp: int, vpp: int) -> list[Problem]:
    """A pinned split (``parallelism.stage_layers``) has one count per model chunk."""
    if split is None or len(split) == pp * vpp:
        return []
    return [Problem("parallelism.stage_layers", f"{len(split)} stages, but pp × vpp = {pp}×{vpp}",
                    f"give {pp * vpp} counts (one per model chunk, in model order), or pin pp "
                    "and vpp to match", DIVISIBILITY)]


def ep_degrees(m: ModelShape, dp: int) -> list[int]:
    """The expert-parallel degrees that divide both the data-parallel replicas and experts."""
    moe = getattr(m, "moe", None)
    experts = moe.experts if moe is not None else 1
    return [e for e in range(1, dp + 1) if dp % e == 0 and experts % e == 0]


def ep_problems(m: ModelShape, dp: int, ep: int, cp: int = 1) -> list[Problem]:
    """ep splits the experts, over groups carved out of the dp × cp ranks of a stage (the
    data-parallel replicas and their context-parallel rings)."""
    moe = getattr(m, "moe", None)
    if ep == 1:
        return []
    if moe is None:
        return [Problem("parallelism.ep", f"ep={ep} but the model has no experts",
                        "set model.moe (e.g. model.preset=tiny-moe) or parallelism.ep=1",
                        DIVISIBILITY)]
    ranks = dp * cp
    if ranks % ep or moe.experts % ep:
        over = f"dp={dp}" if cp == 1 else f"dp × cp = {dp}×{cp} = {ranks}"
        return [Problem("parallelism.ep", f"ep={ep} does not divide both {over} (expert-parallel "
                        f"groups are carved out of the data-parallel replicas) and "
                        f"model.moe.experts={moe.experts}", f"use one of {ep_degrees(m, ranks)}, "
                        "or raise parallelism.dp", DIVISIBILITY)]
    return []


def microbatches_per_replica(global_batch: int, microbatch_size: int, dp: int) -> int:
    """Microbatches each data-parallel replica runs per step. The global batch's
    ``global_batch / microbatch_size`` microbatches are dealt out in contiguous shares that
    differ by at most one; a replica with the smaller share runs one padding microbatch of
    zero weight, so that every replica makes the same collectives (ZeRO-3's per-microbatch
    gathers and reduce-scatters, expert parallel's all-to-alls, the pipeline schedule)."""
    return -(-(global_batch // microbatch_size) // dp)


def dp_fits(global_batch: int, microbatch_size: int, dp: int, pp: int = 1) -> bool:
    """Whether ``dp_problems`` finds nothing, without building its messages (the planner asks
    this of every dp it scans)."""
    if global_batch % microbatch_size:
        return False
    micro = global_batch // microbatch_size
    return dp <= micro and (pp == 1 or microbatches_per_replica(global_batch, microbatch_size, dp) >= pp)


def dp_problems(global_batch: int, microbatch_size: int, dp: int, pp: int = 1) -> list[Problem]:
    """dp deals the global batch's microbatches out to the replicas: any dp up to their number
    (not only one that divides it), each replica's share enough to fill pp stages."""
    if dp_fits(global_batch, microbatch_size, dp, pp):
        return []
    if global_batch % microbatch_size:
        return [Problem("training.global_batch_size", f"{global_batch} is not divisible by "
                        f"microbatch_size={microbatch_size}", "make it a multiple of "
                        "training.microbatch_size", DIVISIBILITY)]
    micro = global_batch // microbatch_size
    if dp > micro:
        return [Problem("parallelism.dp", f"dp={dp} replicas but the global batch holds "
                        f"{micro} microbatches ({global_batch} / microbatch_size "
                        f"{microbatch_size}): a replica would have no data",
                        f"use dp ≤ {micro}, or raise training.global_batch_size or lower "
                        "training.microbatch_size", DIVISIBILITY)]
    share = microbatches_per_replica(global_batch, microbatch_size, dp)
    return [Problem("parallelism.dp", f"dp={dp} leaves each replica {share} microbatch(es) "
                    f"of the global batch, too few to fill pp={pp} pipeline stages",
                    f"use dp ≤ {micro // pp}, or raise training.global_batch_size or lower "
                    "training.microbatch_size", DIVISIBILITY)]


@functools.lru_cache(maxsize=1024)
def divisors(n: int) -> tuple[int, ...]:
    """``n``'s divisors, ascending (a plan's search names them in messages ~10^4 times)."""
    low = [d for d in range(1, math.isqrt(max(n, 0)) + 1) if n % d == 0]
    return tuple(low + [n // d for d in reversed(low) if d * d != n])


def hsdp_problems(dp: int, dp_replicate: int, ep: int = 1, cp: int = 1) -> list[Problem]:
    """Hybrid sharding splits dp into dp_replicate groups of dp / dp_replicate shards; beside
    expert parallel each shard group holds whole EP groups (ep / cp replicas each)."""
    if dp_replicate == 1:
        return []
    if dp % dp_replicate:
        return [Problem("parallelism.dp_replicate", f"dp_replicate={dp_replicate} does not "
                        f"divide dp={dp}", f"use one of "
                        f"{list(divisors(dp))}", DIVISIBILITY)]
    group = ep // cp if ep % cp == 0 else ep  # replicas per EP group (whole cp rings)
    if ep > 1 and (dp // dp_replicate) % group:
        return [Problem("parallelism.dp_replicate", f"dp_replicate={dp_replicate} leaves shard "
                        f"groups of {dp // dp_replicate} replicas, which must hold whole "
                        f"expert-parallel groups of {group} replica(s) (ep={ep}, cp={cp})",
                        f"use a dp_replicate that leaves a multiple of {group} replicas per group: "
                        f"{[d for d in divisors(dp) if (dp // d) % group == 0]}",
                        DIVISIBILITY)]
    return []


def cp_problems(seq_len: int, cp: int, tp: int = 1, ep: int = 1, pp: int = 1,
                split_over_tp: bool = False, document_mask: bool = False) -> list[Problem]:
    """cp splits each sequence into 2·cp chunks (rank i holds chunks i and 2·cp−1−i);
    ``split_over_tp``: the rank's part is split again over tp (sequence parallel, an MoE's
    routing). Expert parallel spans whole context-parallel rings. Document masks need the
    tokens where the attention is: not beside pipeline parallel."""
    out = []
    if (cp > 1 or document_mask) and seq_len % (2 * cp):
        out.append(Problem("training.seq_len", f"{seq_len} is not divisible by 2 × cp = {2 * cp} "
                           "(context parallel and document masks cut each sequence into 2·cp equal chunks)",
                           f"use a multiple of {2 * cp}, or another parallelism.cp", DIVISIBILITY))
    elif cp > 1 and split_over_tp and tp > 1 and (seq_len // cp) % tp:
        out.append(Problem("training.seq_len", f"{seq_len} / cp={cp} is not divisible by tp={tp} "
                           "(each tensor-parallel rank takes a share of its rank's part)",
                           f"use a multiple of {cp * tp}", DIVISIBILITY))
    if cp > 1 and ep > 1 and ep % cp:
        out.append(Problem("parallelism.ep", f"ep={ep} is not a multiple of cp={cp} (an "
                           "expert-parallel group holds whole context-parallel rings)",
                           f"use a multiple of {cp} that divides dp × cp", DIVISIBILITY))
    if document_mask and pp > 1:
        out.append(Problem("data.document_mask", f"pp={pp}: stages after the first do not see "
                           "the tokens that mark the documents", "set parallelism.pp=1 or "
                           "data.document_mask=false"))
    return out


def shape_problems(m: ModelShape, tp: int, pp: int, vpp: int = 1, dp: int = 1,
                   ep: int = 1, cp: int = 1) -> list[Problem]:
    """Every rule a (tp, pp, vpp, dp, ep, cp) layout of model ``m`` breaks in the model's shape."""
    return [*tp_problems(m, tp), *pp_problems(m, pp, vpp), *ep_problems(m, dp, ep, cp)]


def runnable_problems(m: ModelShape, tp: int, pp: int, sequence_parallel: bool = False) -> list[Problem]:
    """What this version does not build for a valid layout."""
    out = []
    if m.tie_embeddings and pp > 1:
        out.append(Problem("model.tie_embeddings", f"pp={pp}: the tied head needs the embedding on "
                           "the last pipeline stage", "set it to false when parallelism.pp > 1", TIED))
    if m.tie_embeddings and tp > 1:
        out.append(Problem("model.tie_embeddings", f"tp={tp}: the tied head is not "
                           "tensor-parallel here", "set it to false when parallelism.tp > 1", TIED))
    if sequence_parallel and tp == 1:
        out.append(Problem("parallelism.sequence_parallel", "needs tensor parallel (tp > 1)",
                           "set it to false or raise parallelism.tp"))
    return out


def float8_device_problems(recipe: str, device_type: str, capability: tuple[int, int] | None,
                           compiled: bool = True) -> list[str]:
    """Why ``training.float8`` cannot run on this device, or should not (empty when it can): on
    a GPU without torch.compile the scaling and casts run as separate kernels, and the float8
    step took 2.1× bf16's (8 of Llama 3 8B's layers, H200, 2026-11-27). (Beside tensor parallel
    it is a layout's problem: ``spec.validate.layout_problems``.)"""
    if recipe == "none":
        return []
    if device_type == "cuda" and capability is not None and capability < (8, 9):
        return [f"training.float8={recipe} needs a GPU of compute capability 8.9 or more (H100, "
                f"L40S, B200); this one is {capability[0]}.{capability[1]}: set "
                "training.float8=none"]
    if device_type == "cuda" and not compiled:
        return [f"training.float8={recipe} without model.compile runs at about half bf16's speed "
                "(torchao's scaling and casts fuse only under torch.compile): set "
                "model.compile=true, or training.float8=none"]
    return []


def relays(choice: str, member_nodes: Sequence[int], top_k: int, overlap: bool) -> bool:
    """Whether an EP group (its ranks on ``member_nodes``) can dispatch in two hops and would
    (``parallelism.ep_dispatch``; ``parallel/expert.py: NodeRelayDispatch``): never on nodes
    holding unequal numbers of its ranks; else as asked, or (auto) where it spans nodes, a
    token takes several experts and the exchanges are not in halves. The engine's rule for
    a rank built without a plan; the planner resolves auto by price too
    (``cost_model.relayed``)."""
    held = Counter(member_nodes).values()
    if len(set(held)) > 1 or choice == "direct":  # (relay there: refused, ``relay_problems``)
        return False
    return choice == "relay" or (len(held) > 1 and top_k > 1 and not overlap)


def consecutive_nodes(world: int, node_ranks: int) -> list[int]:
    """The node of each of ``world`` ranks where consecutive ranks share nodes of
    ``node_ranks`` (``parallelism.ep_node_ranks``)."""
    return [g // node_ranks for g in range(world)]


def ep_groups(pp: int, dp: int, cp: int, tp: int, ep: int) -> list[list[int]]:
    """Every EP group's global ranks, in ep-coordinate order: ranks laid out (pp, dp, cp, tp)
    with tp fastest, an EP group is ``ep`` consecutive positions of a stage's flattened
    (dp, cp) index at one tp coordinate (``parallel/dims.py``)."""
    per_stage = dp * cp
    return [[(p * per_stage + j * ep + e) * tp + t for e in range(ep)]
            for p in range(pp) for t in range(tp) for j in range(per_stage // ep)]


def uneven_ep_nodes(pp: int, dp: int, cp: int, tp: int, ep: int,
                    nodes: Sequence[int]) -> list[int] | None:
    """The ranks each node holds of the first EP group whose nodes (``nodes[g]``: global rank
    g's) hold unequal numbers of its ranks, or None: where ``parallelism.ep_dispatch: relay``
    cannot run."""
    for group in ep_groups(pp, dp, cp, tp, ep) if ep > 1 else ():
        held = Counter(nodes[g] for g in group)
        if len(set(held.values())) > 1:
            return sorted(held.values())
    return None
