"""The layouts their authors published for some presets' models, priced on the cluster being
planned beside the planner's choice: the same cost model, the published degrees pinned, the
rest (interleaving, schedule, microbatches, recomputation, sharding) chosen as for any plan.
What a published layout relies on that the cost model does not price is said with it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trainmesh.planning.planner import PlanResult, plan, summarize_rejections
from trainmesh.planning.topology import Topology


@dataclass(frozen=True)
class Published:
    """One published layout: where it is from (and on what), its degrees (dp: what the rest of
    the cluster holds), and what of it the cost model does not price."""

    source: str
    degrees: dict[str, int]
    not_priced: str


PUBLISHED = {
    "deepseek-v3-671b": Published(
        "DeepSeek-V3's technical report (2,048 H800)", {"tp": 1, "pp": 16, "ep": 64, "cp": 1},
        "DualPipe's two pipelines in both directions (its V half, dualpipev, is priced with "
        "its pairs hiding the all-to-all where the search picks it), ZeRO-1 "
        "(priced here as ZeRO-3 or hybrid sharding), FP8 matmuls, and DeepEP's kernels (the "
        "relay's two hops priced as all-to-alls at the links' bandwidths)"),
    "405b": Published(
        "the Llama 3 paper (16,384 H100, 8k tokens)", {"tp": 8, "pp": 16, "cp": 1},
        "its pipeline schedule's own tuning (how many microbatches each stage runs in a row)"),
}

# The step's parts, as the plan explains them: (Estimate field, what it is)
PARTS = (("compute_s", "compute (the bubble included)"), ("ep_comm_s", "MoE all-to-all"),
         ("tp_comm_s", "TP communication"), ("pp_comm_s", "PP communication"),
         ("dp_exposed_s", "exposed data-parallel traffic"), ("cp_comm_s", "context-parallel traffic"))


def published_layout(model) -> Published | None:
    """The layout published for ``model``'s preset, if it has one and the spec keeps the
    preset's shape (a changed shape is another model)."""
    pub = PUBLISHED.get(model.preset) if model.preset else None
    if pub is None:
        return None
    shape = type(model)(preset=model.preset)  # the preset as shipped
    same = model.model_dump(include=SHAPE) == shape.model_dump(include=SHAPE)
    return pub if same else None


# The fields that make a model's shape (what a published layout was chosen for)
SHAPE = {"dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "moe", "mla"}


def degrees_label(degrees: dict[str, int]) -> str:
    return " × ".join(f"{k}={v}" for k, v in degrees.items() if v > 1 or k in ("tp", "pp"))


def price(req, topo: Topology, pub: Published) -> PlanResult | str:
    """``pub``'s degrees on ``topo`` (``req``: the spec's plan request), the rest planned; or
    why it cannot run there."""
    d = pub.degrees
    per_replica = d.get("tp", 1) * d.get("pp", 1) * d.get("cp", 1)
    if topo.world_size % per_replica:
        return (f"{topo.world_size} accelerators do not divide into its tp × pp × cp = "
                f"{per_replica}")
    fixed = {**{k: v for k, v in req.fixed.items() if k not in ("max_ep", "max_dp_replicate")},
             **d, "dp": topo.world_size // per_replica}
    result = plan(dataclasses.replace(req, fixed=fixed), topo)
    if not result.plans:
        return "it does not fit here: " + summarize_rejections(result.rejected)
    return result


def _nodes(c, per_node: int) -> int:
    """Nodes one expert-parallel group spans (its ranks: ep × tp, consecutive)."""
    return max(1, -(-c.ep * c.tp // per_node))


def compare(ours: PlanResult, theirs: PlanResult | str, pub: Published, per_node: int) -> str:
    """A paragraph: the published layout as priced here, beside the choice, and where the
    difference comes from (the step's parts that differ most, the nodes an expert group
    spans, ``per_node`` accelerators a node), then what is not priced."""
    head = f"Published: {pub.source}, {degrees_label(pub.degrees)}"
    if isinstance(theirs, str):
        return f"{head}: {theirs}. Not priced: {pub.not_priced}."
    a, b = ours.best, theirs.best
    ea, eb = a.estimate, b.estimate
    c = b.candidate
    gap = 1 - eb.tokens_per_s / ea.tokens_per_s
    text = [f"{head}, priced on this cluster (dp={c.dp}{f' (ep={c.ep} over dp)' if c.ep > 1 else ''}, "
            f"vpp={c.vpp}, {c.schedule}, microbatch {c.microbatch_size} × {c.num_microbatches}, "
            f"recompute {c.recompute}): {eb.tokens_per_s:,.0f} tokens/s, "
            f"{abs(gap):.1%} {'slower' if gap >= 0 else 'faster'} than the choice, "
            f"{eb.memory_per_rank_gib:.1f} GiB per rank against {ea.memory_per_rank_gib:.1f}."]
    diffs = sorted(((getattr(eb, f) - getattr(ea, f), what, getattr(ea, f), getattr(eb, f))
                    for f, what in PARTS), key=lambda t: -abs(t[0]))
    shown = [f"{what} {y:.3g} s against the choice's {x:.3g} s" for d, what, x, y in diffs[:2]
             if abs(d) >= 0.01 * eb.step_time_s]
    if shown:
        text.append("Of its step (" + f"{eb.step_time_s:.3g} s against {ea.step_time_s:.3g} s), "
                    + "; ".join(shown) + ".")
    if c.ep != a.candidate.ep:
        crossing = ("a token's copies cross nodes where the groups do" if not eb.ep_relay else
                    f"relayed, a token crosses once to each node its experts sit on "
                    f"({eb.ep_nodes_reached:.2g} on average), not once per copy")
        text.append(f"Its ep={c.ep} spreads each expert group over {_nodes(c, per_node)} "
                    f"node(s) of {per_node}, the choice's ep={a.candidate.ep} over "
                    f"{_nodes(a.candidate, per_node)}: {crossing}.")
    text.append(f"Not priced: {pub.not_priced}.")
    return " ".join(text)
