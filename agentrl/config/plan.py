"""Resolve a RunConfig into a RunPlan: which nodes train and which serve, the Megatron layout,
the DSA-valid pipeline split and every engine's command line.

The plan is pure data (no Ray, no processes): the launcher prints it with --dry-run and the
cluster code places actors from it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from agentrl.config.pipeline import PipelineSplitError, auto_split, check_split, stage_sizes
from agentrl.config.schema import RunConfig
from agentrl.models.arch import ModelArch, get_arch
from agentrl.rollout.sglang_cmd import build_sglang_command


class PlanError(ValueError):
    """The config cannot be laid out on the cluster; the message says why and what to change."""


@dataclass
class Parallel:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    dp: int = 1


@dataclass
class EngineSpec:
    index: int
    kind: str  # "sglang" or "embedded"
    nodes: list[int]  # an engine may span nodes
    gpus: int  # GPUs in total
    port: int
    command: list[str]  # argv on its first node (node_rank 0)
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class NodeRole:
    node: int
    role: str  # "train", "inference" or "train+inference" (one machine)
    gpus: int


@dataclass
class RunPlan:
    model: str
    hardware: str
    num_nodes: int
    gpus_per_node: int
    train_nodes: int
    inference_nodes: int
    train_gpus: int
    backend: str  # trainer backend: torch | megatron
    engine_kind: str  # sglang | embedded
    parallel: Parallel
    expert_dp: int
    pp_layer_split: list[int]
    pp_stage_first_layers: list[int]
    max_tokens_per_gpu: int
    engines: list[EngineSpec]
    node_roles: list[NodeRole]
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        d = asdict(self)
        d["engines"] = [
            {"index": e.index, "kind": e.kind, "node": e.nodes[0], "nodes": e.nodes, "gpus": e.gpus,
             "port": e.port, "command": " ".join(e.command), "env": e.env}
            for e in self.engines
        ]
        return d


def _pow2_floor(x: int) -> int:
    p = 1
    while p * 2 <= x:
        p *= 2
    return p


# Layouts of the reference recipes (REFERENCE.md section 1), keyed by (GPUs per node, training
# world size), for the full-depth model: 8 nodes x 4 GPUs -> TP2/CP4/PP4/EP8 (the agentic
# example); 32 nodes x 8 GPUs -> TP4/PP8/CP8/EP32.
RECIPE_LAYOUTS = {
    (4, 32): {"tp": 2, "pp": 4, "cp": 4, "ep": 8},
    (8, 256): {"tp": 4, "pp": 8, "cp": 8, "ep": 32},
}


def _default_parallel(arch: ModelArch, world: int, gpus_per_node: int, fixed: dict[str, int]) -> dict[str, int]:
    """Fill the dims the user left unset. A recipe layout is used when the shape matches and
    agrees with every fixed dim; otherwise a generic rule fills the gaps around the fixed ones."""
    deep = arch.num_layers >= 40
    preset = RECIPE_LAYOUTS.get((gpus_per_node, world)) if deep else None
    if preset and all(preset[k] == v for k, v in fixed.items()):
        return preset
    out = dict(fixed)
    if "tp" not in out:
        # TP stays inside a node; 4 at most for the big model (MLA heads split well up to there);
        # small models are not tensor-split unless wide.
        if deep:
            out["tp"] = min(gpus_per_node, 4) if gpus_per_node >= 8 else min(gpus_per_node, 2)
        else:
            out["tp"] = min(gpus_per_node, 4, world) if arch.hidden_size >= 1024 else 1
    if "pp" not in out:
        out["pp"] = 4 if deep and world >= out["tp"] * 4 else 1
    if "cp" not in out:
        # Long agentic contexts: CP up to 4 with what TP x PP leave; the rest is data parallel.
        room = max(1, world // (out["tp"] * out["pp"]))
        out["cp"] = _pow2_floor(min(4, room)) if deep else 1
    if "ep" not in out:
        out["ep"] = _largest_divisor(arch.n_routed_experts, max(1, world // out["pp"])) if arch.n_routed_experts else 1
    return out


def _largest_divisor(n: int, limit: int) -> int:
    """Largest d <= limit with n % d == 0 (how many ranks the n experts spread over)."""
    for d in range(min(n, limit), 0, -1):
        if n % d == 0:
            return d
    return 1


def _split_nodes(cfg: RunConfig) -> tuple[int, int, bool]:
    c = cfg.cluster
    if c.num_nodes == 1:
        return 1, 1, True  # one machine: both roles share it
    train = c.train_nodes if c.train_nodes is not None else c.num_nodes // 2
    if train >= c.num_nodes:
        raise PlanError(
            f"cluster.train_nodes={train} leaves no inference node in a {c.num_nodes}-node cluster; "
            f"set cluster.train_nodes below {c.num_nodes}"
        )
    return train, c.num_nodes - train, False


def resolve_plan(cfg: RunConfig) -> RunPlan:
    arch = get_arch(cfg.model.name)
    c = cfg.cluster
    gpu = c.gpus_per_node > 0 and c.hardware != "cpu"
    if c.hardware != "cpu" and c.gpus_per_node == 0:
        raise PlanError(f"cluster.hardware={c.hardware} needs cluster.gpus_per_node > 0")
    if c.hardware == "cpu" and c.gpus_per_node > 0:
        raise PlanError("cluster.gpus_per_node > 0 needs cluster.hardware set to H200, B200 or GB300")
    train_nodes, infer_nodes, shared = _split_nodes(cfg)
    warnings: list[str] = []

    backend = cfg.train.backend
    if backend == "auto":
        backend = "megatron" if gpu else "torch"
    if backend == "megatron" and not gpu:
        raise PlanError("train.backend=megatron needs GPUs; use train.backend=torch on a CPU machine")
    engine_kind = cfg.rollout.engine
    if engine_kind == "auto":
        engine_kind = "sglang" if gpu else "embedded"
    if engine_kind == "sglang" and not gpu:
        raise PlanError("rollout.engine=sglang needs GPUs; use rollout.engine=embedded on a CPU machine")

    # GPUs per role. One machine: the trainer takes the first half, engines the rest (fully
    # async needs disjoint devices: a colocated engine would stall during training steps).
    if gpu:
        if shared:
            if c.gpus_per_node < 2:
                raise PlanError("a 1-node GPU run needs at least 2 GPUs (one trains, one serves)")
            train_gpus = c.gpus_per_node // 2
            infer_gpus_per_node = c.gpus_per_node - train_gpus
        else:
            train_gpus = train_nodes * c.gpus_per_node
            infer_gpus_per_node = c.gpus_per_node
    else:
        train_gpus, infer_gpus_per_node = 0, 0

    parallel, expert_dp = _resolve_parallel(cfg, arch, max(train_gpus, 1), c.gpus_per_node or 1, gpu)
    sizes, starts = _resolve_split(cfg, arch, parallel.pp)

    engines = _resolve_engines(cfg, arch, engine_kind, train_nodes if not shared else 0,
                               infer_nodes, infer_gpus_per_node, shared)
    if shared:
        roles = [NodeRole(0, "train+inference", c.gpus_per_node)]
    else:
        roles = [NodeRole(i, "train", c.gpus_per_node) for i in range(train_nodes)]
        roles += [NodeRole(train_nodes + i, "inference", c.gpus_per_node) for i in range(infer_nodes)]

    return RunPlan(
        model=arch.name, hardware=c.hardware, num_nodes=c.num_nodes, gpus_per_node=c.gpus_per_node,
        train_nodes=train_nodes, inference_nodes=infer_nodes, train_gpus=train_gpus, backend=backend,
        engine_kind=engine_kind, parallel=parallel, expert_dp=expert_dp, pp_layer_split=sizes,
        pp_stage_first_layers=starts, max_tokens_per_gpu=cfg.train.parallel.max_tokens_per_gpu,
        engines=engines, node_roles=roles, warnings=warnings,
    )


def _resolve_parallel(cfg: RunConfig, arch: ModelArch, world: int, gpus_per_node: int, gpu: bool):
    p = cfg.train.parallel
    if not gpu:
        given = {k: getattr(p, k) for k in ("tp", "pp", "cp", "ep") if getattr(p, k) not in (None, 1)}
        if given:
            raise PlanError(f"the torch backend on CPU runs unsharded; remove train.parallel settings {given}")
        return Parallel(), 1
    fixed = {k: getattr(p, k) for k in ("tp", "pp", "cp", "ep") if getattr(p, k) is not None}
    dims = _default_parallel(arch, world, gpus_per_node, fixed)
    tp, pp, cp, ep = dims["tp"], dims["pp"], dims["cp"], dims["ep"]
    etp = p.etp
    if tp > gpus_per_node:
        raise PlanError(f"train.parallel.tp={tp} exceeds the {gpus_per_node} GPUs of a node; TP must stay inside a node")
    if arch.num_attention_heads and arch.num_attention_heads % tp:
        raise PlanError(f"train.parallel.tp={tp} does not divide {arch.name}'s {arch.num_attention_heads} attention heads")
    if world % (tp * pp * cp):
        raise PlanError(
            f"training world size {world} GPUs is not divisible by TP*PP*CP = {tp}*{pp}*{cp} = {tp * pp * cp}; "
            f"change train.parallel or cluster.train_nodes"
        )
    dp = world // (tp * pp * cp)
    if arch.n_routed_experts:
        if arch.n_routed_experts % ep:
            raise PlanError(f"train.parallel.ep={ep} does not divide {arch.name}'s {arch.n_routed_experts} experts")
        if (world // pp) % (ep * etp):
            raise PlanError(
                f"EP*ETP = {ep}*{etp} must divide the {world // pp} GPUs of a pipeline stage "
                f"(world {world} / PP {pp}); change train.parallel.ep or etp"
            )
        expert_dp = world // (pp * ep * etp)
    else:
        if ep != 1:
            raise PlanError(f"{arch.name} has no experts; train.parallel.ep must be 1, not {ep}")
        expert_dp = dp
    return Parallel(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, dp=dp), expert_dp


def _resolve_split(cfg: RunConfig, arch: ModelArch, pp: int) -> tuple[list[int], list[int]]:
    p = cfg.train.parallel
    try:
        if p.pp_layer_split is not None:
            if len(p.pp_layer_split) != pp:
                raise PlanError(f"train.parallel.pp_layer_split has {len(p.pp_layer_split)} stages but pp={pp}")
            sizes = list(p.pp_layer_split)
        elif p.pp_first_stage_layers is not None or p.pp_last_stage_layers is not None:
            if pp == 1:
                raise PlanError("pp_first_stage_layers / pp_last_stage_layers need train.parallel.pp > 1")
            sizes = stage_sizes(arch.num_layers, pp, p.pp_first_stage_layers, p.pp_last_stage_layers)
        else:
            sizes = auto_split(arch, pp)
        return sizes, check_split(arch, sizes)
    except PipelineSplitError as e:
        raise PlanError(str(e)) from None


def _resolve_engines(cfg, arch, kind, first_node, infer_nodes, gpus_per_node, shared) -> list[EngineSpec]:
    host = cfg.cluster.host
    model_path = str(cfg.model.local_dir or cfg.model.path or cfg.model.name)
    if kind == "embedded":
        e = cfg.rollout.embedded
        base = e.base_port
        extra = ["--max-batch-size", str(e.max_batch_size), "--prefix-cache-tokens", str(e.prefix_cache_tokens)]
        if e.torch_threads:
            extra += ["--torch-threads", str(e.torch_threads)]
        return [
            EngineSpec(index=i, kind="embedded", nodes=[first_node], gpus=0, port=base + i if base else 0,
                       command=["agentrl", "engine", "serve", "--model", model_path, "--host", host,
                                "--port", str(base + i if base else 0), *extra])
            for i in range(e.num_engines)
        ]
    s = cfg.rollout.sglang
    per = s.gpus_per_engine
    if per <= gpus_per_node:
        if gpus_per_node % per:
            raise PlanError(
                f"rollout.sglang.gpus_per_engine={per} does not divide the {gpus_per_node} GPUs an inference node offers"
            )
        per_node, span = gpus_per_node // per, 1
    else:
        if per % gpus_per_node or shared:
            raise PlanError(
                f"an engine of {per} GPUs is wider than a node of {gpus_per_node}; it must span whole nodes "
                f"(set rollout.sglang.gpus_per_engine to a divisor or multiple of {gpus_per_node})"
            )
        per_node, span = 0, per // gpus_per_node
    engines: list[EngineSpec] = []
    if span == 1:
        slots = [(first_node + n, k) for n in range(infer_nodes) for k in range(per_node)]
        for i, (node, k) in enumerate(slots):
            port = s.base_port + 10 * k
            engines.append(EngineSpec(i, "sglang", [node], per, port,
                                      build_sglang_command(s, model_path, host=host, port=port, dsa=arch.has_dsa),
                                      env=dict(s.env)))
    else:
        if infer_nodes % span:
            raise PlanError(f"{infer_nodes} inference nodes cannot hold engines spanning {span} nodes each")
        for i in range(infer_nodes // span):
            nodes = list(range(first_node + i * span, first_node + (i + 1) * span))
            cmd = build_sglang_command(s, model_path, host=host, port=s.base_port, nnodes=span, node_rank=0,
                                       dist_init_addr=f"<node{nodes[0]}>:{s.base_port + 1000}", dsa=arch.has_dsa)
            engines.append(EngineSpec(i, "sglang", nodes, per, s.base_port, cmd, env=dict(s.env)))
    if not engines:
        raise PlanError("the plan has no inference engine; add inference nodes or GPUs")
    return engines
