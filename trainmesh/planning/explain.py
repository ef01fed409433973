"""Why the planner chose its plan, in words (``trainmesh plan``'s explanation): the layout and
its stages, the step's parts, the microbatch size and sharding against the alternatives the
search weighed, the best other layout, what was rejected. Reads a search's ``PlanResult``."""

from __future__ import annotations

import dataclasses

from trainmesh.models.llama.model_math import stage_split
from trainmesh.planning.candidate import Candidate, runs_ddp
from trainmesh.planning.devices import DeviceSpec
from trainmesh.planning.planner import PlanResult, RankedPlan, degrees_of, summarize_rejections


def _overlap_text(e) -> str:
    """The MoE exchanges in two halves (``parallelism.ep_overlap``): what they hide, or would
    (the planner prices them but leaves them as the spec says)."""
    gain = e.ep_overlap_gain_s
    if e.ep_overlap:
        return (f" (each microbatch's exchanges in two halves, parallelism.ep_overlap: the step "
                f"{gain:.3g} s {'shorter' if gain >= 0 else 'longer'} than with them whole).")
    if gain > 0:
        return (f"; in two halves (parallelism.ep_overlap: true) they would hide behind the "
                f"experts, a step predicted {gain / (e.step_time_s - gain):.1%} faster (off "
                "unless set: not yet measured on GPUs).")
    return (f"; in two halves (parallelism.ep_overlap) the step would take {-gain:.3g} s "
            "more: what they hide is less than issuing the experts' work twice and the "
            "messages' latency add.")


def _pair_text(e, c: Candidate) -> str:
    """DualPipeV's pairs (``schedule.pair_overlap``): what they hide of the exchanges."""
    if c.schedule != "dualpipev" or c.ep == 1:
        return ""
    if not c.pair_overlap:
        return (" DualPipeV's pairs run their forward and backward one after the other "
                "(schedule.pair_overlap: false): their exchanges stay exposed.")
    from trainmesh.planning.cost_model import paired_share

    return (f" DualPipeV's pairs hide {e.ep_pair_hidden_s:.3g} s of the exchanges: "
            f"{paired_share(c.pp, c.num_microbatches):.0%} of a rank's forwards and backwards "
            "run in pairs, each half's exchanges in flight while the other computes "
            "(the warm-up's and the drain's stay exposed).")


def _relay_text(e, model) -> str:
    """How tokens cross between nodes (``parallelism.ep_dispatch``): what the relay saves or
    costs where it runs, or would save where an EP group spans nodes (not beside ep_overlap,
    whose halves' exchanges are direct)."""
    moe, gain = model.moe, e.ep_relay_gain_s
    if e.ep_relay and e.ep_nodes == 1:
        return (f" Its exchanges run in two hops inside one node (parallelism.ep_dispatch: "
                f"relay): nothing crosses between nodes to save, the step {-gain:.3g} s longer.")
    if e.ep_nodes == 1 or e.ep_overlap:
        return ""
    capped = (f", at most topk_group={moe.topk_group}: the router's {moe.n_group} groups map "
              f"onto its {e.ep_nodes} nodes" if moe.n_group > 1 and moe.n_group % e.ep_nodes == 0
              else "")
    reach = (f"a token's {moe.top_k} experts sit on {e.ep_nodes_reached:.2g} of {e.ep_nodes} "
             f"nodes on average" + capped)
    if e.ep_relay:
        return (f" Its tokens cross between nodes in two hops (parallelism.ep_dispatch: relay): "
                f"once to each node reached, not once per expert ({reach}); the step "
                f"{abs(gain):.3g} s {'shorter' if gain >= 0 else 'longer'} than sending each "
                "copy directly.")
    if gain > 0:
        return (f" Relayed (parallelism.ep_dispatch: relay) a token would cross once to each "
                f"node reached ({reach}), the step {gain:.3g} s shorter.")
    return (f" Relaying would not pay here ({reach}): its second hop costs "
            f"{-gain:.3g} s more than the copies it saves between nodes.")


def _microbatch_choice(result: PlanResult, best: RankedPlan, device: DeviceSpec) -> list[str]:
    """Why this microbatch size: the same plan at the smallest size that was weighed, its
    time (each microbatch pays a fixed device cost per block, and the host's issuing of the
    block's work where that is longer) and memory."""
    c, e = best.candidate, best.estimate
    line = ([f"The host issuing its blocks' work bounds the step ({device.host_dispatch_s * 1e3:.2g} "
             f"ms per block and microbatch, longer than the device runs one of {c.microbatch_size}):"
             " the GPU waits for its host."] if e.host_bound else [])
    same = [p for p in result.plans if p.candidate.microbatch_size < c.microbatch_size
            and dataclasses.replace(p.candidate, microbatch_size=c.microbatch_size,
                                    num_microbatches=c.num_microbatches, padding=c.padding) == c]
    if not same or device.host_dispatch_s == device.kernel_overhead_s == 0:
        return line
    alt = result.priced(min(same, key=lambda p: p.candidate.microbatch_size))
    a, ae = alt.candidate, alt.estimate
    return line + [
        f"Microbatch {c.microbatch_size} rather than {a.microbatch_size}: each microbatch pays the "
        f"device's fixed costs per block ({device.kernel_overhead_s * 1e3:.2g} ms) or, where "
        f"longer, the host's time to issue the block ({device.host_dispatch_s * 1e3:.2g} ms"
        + (f"; longer at microbatch {a.microbatch_size}" if ae.host_bound else "")
        + f"); {a.num_microbatches} microbatches of {a.microbatch_size} would take "
        f"{ae.step_time_s / e.step_time_s:.2f}× as long and hold "
        f"{e.memory_per_rank_gib - ae.memory_per_rank_gib:.1f} GiB less per rank."]


def _sharding_choice(result: PlanResult, best: RankedPlan) -> list[str]:
    """Why ZeRO-3 shards over all of dp or in hybrid groups, where the planner weighed both:
    the same plan under the other sharding, its exposed ZeRO-3 time and memory."""
    c = best.candidate
    same = [p for p in result.plans if p.candidate != c and dataclasses.replace(
        p.candidate, dp_replicate=c.dp_replicate) == c]
    if not same:
        return []
    alt = min((result.priced(p) for p in same), key=lambda p: p.estimate.dp_exposed_s)
    a, e, ae = alt.candidate, best.estimate, alt.estimate

    def name(x: Candidate) -> str:
        if runs_ddp(result.model, x):
            return (f"DDP (no sharding: each of the {x.dp} replicas holds the whole state, "
                    "gradients all-reduced while backward runs)")
        if x.dp_replicate > 1 and x.dp_shard == 1:
            return f"no sharding ({x.dp} replicas, gradients all-reduced)"
        return (f"hybrid sharding {x.dp_replicate}×{x.dp_shard} (ZeRO-3 inside groups of "
                f"{x.dp_shard} replicas, gradients all-reduced across {x.dp_replicate} groups)"
                if x.dp_replicate > 1 else f"ZeRO-3 over all {x.dp} replicas")
    return [f"It runs {name(c)}: {_ms(e.dp_exposed_s)} of its step is exposed "
            f"data-parallel traffic and latency, against {_ms(ae.dp_exposed_s)} with "
            f"{name(a)}, which holds {ae.memory_per_rank_gib:.1f} GiB per rank instead of "
            f"{e.memory_per_rank_gib:.1f} (each collective's latency grows with its ring)."]


def _ms(seconds: float) -> str:
    """A duration as ms, three significant digits and no exponent ("7,510 ms", "0.412 ms")."""
    ms = seconds * 1e3
    return f"{ms:,.0f} ms" if ms >= 1000 else f"{float(f'{ms:.3g}'):g} ms"


def _runs(counts: list[int]) -> str:
    """Stage sizes in order, a run of equal ones as count × stages: ``3, 4 ×13, 3 ×2``."""
    out: list[list[int]] = []
    for n in counts:
        if out and out[-1][0] == n:
            out[-1][1] += 1
        else:
            out.append([n, 1])
    return ", ".join(f"{n} ×{k}" if k > 1 else str(n) for n, k in out)


def explain(result: PlanResult) -> str:
    """One paragraph on why the winner won."""
    best = result.best
    c, e = best.candidate, best.estimate
    ep = f" (ep={c.ep} over dp{' × cp' if c.cp > 1 else ''})" if c.ep > 1 else ""
    cp = f" × cp={c.cp} ({c.cp_mode})" if c.cp > 1 else ""
    parts = [f"tp={c.tp} × pp={c.pp} × dp={c.dp}{cp}{ep} (vpp={c.vpp}, {c.schedule}, microbatch "
             f"{c.microbatch_size} × {c.num_microbatches}, recompute {c.recompute}) is predicted "
             f"fastest at {e.tokens_per_s:,.0f} tokens/s and {e.mfu:.1%} MFU, using "
             f"{e.memory_per_rank_gib:.1f} GiB per rank."]
    if c.pp > 1:
        split = stage_split(result.model.n_layers, c.pp * c.vpp, c.stage_layers)
        uneven = len(set(split)) > 1
        pinned = result.request is not None and "stage_layers" in result.request.fixed
        why = ("as pinned (parallelism.stage_layers)" if pinned else
               "split by their cost: the head, the loss and any multi-token modules on the "
               "last stage; a model's dense blocks cost other than its MoE ones"
               if c.stage_layers else
               f"pp × vpp does not divide the {result.model.n_layers}: the extra ones on the "
               "stages between the first, with the embedding, and the last, with the head and "
               "the loss")
        parts.append(f"Its {c.pp * c.vpp} pipeline stages hold "
                     + (_runs(split) if uneven else f"{split[0]} blocks each")
                     + (f" blocks ({why})." if uneven else "."))
    if best.idle:
        parts.append(f"It runs {c.world_size} ranks on {len(best.node_ranks)} node(s) and leaves "
                     f"{best.idle} accelerator(s) idle, the fewest any plan does: TP groups stay "
                     f"whole inside a node, replicas are whole tp×pp groups, at most one per "
                     f"microbatch, whose count fills the pipeline.")
    if c.padding:
        parts.append(f"Every replica runs {c.num_microbatches} microbatches for the "
                     f"{c.dp * c.num_microbatches - c.padding} of the batch: {c.padding} of them "
                     f"padding of weight 0 (dp={c.dp} does not divide the batch), so that every "
                     "replica makes the same collectives; the padding's compute is counted in "
                     "the step time.")
    parts.append(f"Of its {e.step_time_s:.3g} s step, compute is {e.compute_s:.3g} s "
                 f"(bubble {e.bubble_fraction:.1%}), TP communication {e.tp_comm_s:.3g} s, "
                 f"PP {e.pp_comm_s:.3g} s"
                 + (f", exposed ZeRO-3 traffic {e.dp_exposed_s:.3g} s and MoE all-to-all "
                    f"{e.ep_comm_s:.3g} s" + _overlap_text(e) + _pair_text(e, c)
                    + _relay_text(e, result.model)
                    if c.ep > 1
                    else f" and exposed {'DDP all-reduce' if runs_ddp(result.model, c) else 'ZeRO-3'} "
                         f"traffic {e.dp_exposed_s:.3g} s."))
    if c.cp > 1:
        parts.append(f"Context parallel splits each sequence over {c.cp} ranks: their "
                     f"activations are 1/{c.cp} of a whole sequence's, and "
                     f"{e.cp_comm_s:.3g} s of the step is {c.cp_mode} key/value traffic that "
                     "the attention does not hide.")
    parts += _microbatch_choice(result, best, result.device) if result.device else []
    parts += _sharding_choice(result, best)
    degrees = degrees_of(c)
    others = [p for p in result.plans if degrees_of(p.candidate) != degrees]
    if others:
        nxt = result.first_priced(others)
        gap = 1 - nxt.estimate.tokens_per_s / e.tokens_per_s
        n = nxt.candidate
        more = f", leaving {nxt.idle - best.idle} more idle" if nxt.idle > best.idle else ""
        parts.append(f"The best other layout (tp={n.tp}, pp={n.pp}, dp={n.dp}, cp={n.cp}, vpp={n.vpp}, "
                     f"{n.schedule}, recompute {n.recompute}{more}) is predicted "
                     f"{abs(gap):.1%} {'slower' if gap >= 0 else 'faster'}.")
    float8 = result.request.float8 if result.request is not None else "none"
    if float8 != "none" and result.device is not None and result.device.float8_tflops:
        g = e.float8_gain_s
        parts.append(f"float8 ({float8}) linears: predicted {abs(g):.3g} s a step "
                     f"{'faster' if g >= 0 else 'slower'} than bf16 (their matmuls at the "
                     f"float8 peak, {result.device.float8_tflops:g} TFLOP/s, less their casts"
                     + ("; the host issuing the casts' kernels bounds the step" if e.host_bound
                        else "") + ").")
    if result.rejected:
        parts.append("Rejected: " + summarize_rejections(result.rejected) + ".")
    if result.unpriced:
        parts.append(f"Not priced: {result.unpriced} layout(s) leaving more accelerators idle "
                     f"than the {len(result.plans)} plans weighed (none could come first).")
    return " ".join(parts)
