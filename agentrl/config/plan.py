"""Resolve a RunConfig into a RunPlan: which nodes train and which serve, the trainer's Layout
(agentrl.config.layout), the DSA-valid pipeline split, the engines, and the weight transport.

The plan is pure data (no Ray, no processes). It is the one input that decides layout: the
launcher prints it with --dry-run, the trainer ranks, the engines and the weight transport are
built from it (actors receive `plan.to_json()`), and it refuses what the chosen trainer backend
or transport cannot run, so the dry run never shows a plan that `train` would reject.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from agentrl.config.layout import Layout, LayoutError
from agentrl.config.pipeline import PipelineSplitError, auto_split, check_split, stage_sizes
from agentrl.config.schema import RunConfig
from agentrl.models.arch import ModelArch, get_arch


class PlanError(ValueError):
    """The config cannot be laid out on the cluster; the message says why and what to change."""


@dataclass(frozen=True)
class EngineSpec:
    """One inference engine. Its command line is built where it runs (agentrl.rollout.engine_cmd),
    because only that node knows its IP and free ports."""

    index: int
    kind: str  # "sglang" or "embedded"
    nodes: list[int]  # plan node indices it spans; node_rank = position in this list
    gpus_per_node: float  # GPUs it takes on each of its nodes (0: CPU; 0.5: shares a GPU with the trainer)
    port: int  # HTTP port on node_rank 0; 0 = a free port there
    model_path: str  # the rollout checkpoint it loads (HF, or pre-converted FP8 HF; a named model when embedded)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def gpus(self) -> float:
        return self.gpus_per_node * len(self.nodes)


@dataclass(frozen=True)
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
    backend: str  # trainer backend: torch | megatron
    engine_kind: str  # sglang | embedded
    layout: Layout
    ranks_per_train_node: int  # trainer ranks on each training node (ranks fill nodes in order)
    gpus_per_rank: float  # 1 on GPU, 0.5 when colocated with an engine, 0 on CPU
    max_tokens_per_gpu: int
    engines: list[EngineSpec]
    node_roles: list[NodeRole]
    weight_transport: str  # http_tensors | nccl | cuda_ipc
    colocated: bool = False
    serves_fp8: bool = False  # SGLang engines serve FP8 (rollout.sglang.quantization=fp8)
    weight_sync_fp8: bool = False  # updates are sent FP8 (rollout.weight_sync_fp8)
    warnings: list[str] = field(default_factory=list)

    @property
    def train_gpus(self) -> int:
        """GPUs the trainer holds in total (0 on CPU)."""
        return int(self.layout.world * self.gpus_per_rank + 0.5) if self.gpus_per_rank else 0

    def rank_node(self, rank: int) -> int:
        """Plan node index of trainer rank `rank` (ranks fill training nodes in order: node, then GPU)."""
        if not 0 <= rank < self.layout.world:
            raise PlanError(f"rank {rank} is outside the trainer's world of {self.layout.world}")
        return rank // self.ranks_per_train_node

    def to_json(self) -> dict:
        d = asdict(self)
        d["layout"] = self.layout.to_json()
        d["train_gpus"] = self.train_gpus
        return d

    @classmethod
    def from_json(cls, d: dict) -> RunPlan:
        d = dict(d)
        d.pop("train_gpus", None)
        d["layout"] = Layout.from_json(d["layout"])
        d["engines"] = [EngineSpec(**e) for e in d["engines"]]
        d["node_roles"] = [NodeRole(**r) for r in d["node_roles"]]
        return cls(**d)


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


def _default_dims(arch: ModelArch, world: int, gpus_per_node: int, fixed: dict[str, int]) -> dict[str, int]:
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


def resolve_plan(cfg: RunConfig, *, check_runnable: bool = True) -> RunPlan:
    """The plan of `cfg`. With `check_runnable` (what `train` and `--dry-run` use) a layout the
    trainer backend or a transport the engines cannot run is a PlanError naming the field; the
    layout arithmetic alone (tests of recipe shapes, the rehearsal's placement) passes False."""
    arch = get_arch(cfg.model.name)
    c = cfg.cluster
    gpu = c.gpus_per_node > 0 and c.hardware != "cpu"
    if c.hardware != "cpu" and c.gpus_per_node == 0:
        raise PlanError(f"cluster.hardware={c.hardware} needs cluster.gpus_per_node > 0")
    if c.hardware == "cpu" and c.gpus_per_node > 0:
        raise PlanError("cluster.gpus_per_node > 0 needs cluster.hardware set to H200, B200 or GB300")
    if c.colocate and not gpu:
        raise PlanError("cluster.colocate shares GPUs between the trainer and the engines; it needs a GPU run")
    train_nodes, infer_nodes, shared = _split_nodes(cfg)

    backend = cfg.train.backend
    if backend == "auto":
        backend = "megatron" if gpu else "torch"
    engine_kind = cfg.rollout.engine
    if engine_kind == "auto":
        engine_kind = "sglang" if gpu else "embedded"
    if engine_kind == "sglang" and not gpu:
        raise PlanError("rollout.engine=sglang needs GPUs; use rollout.engine=embedded on a CPU machine")

    # Trainer ranks per training node. One machine: the trainer takes the first half of the GPUs,
    # engines the rest (fully async needs disjoint devices: a colocated engine stalls while the
    # trainer steps), unless cluster.colocate puts both on every GPU (a one-GPU smoke run).
    if gpu:
        if c.cpu_trainer_ranks != 1:
            raise PlanError("cluster.cpu_trainer_ranks is for CPU runs; a GPU run has one trainer rank per GPU")
        if c.colocate:
            if not shared:
                raise PlanError("cluster.colocate is for a one-node run; set cluster.num_nodes=1")
            # Half of every GPU each: Ray then places a rank and an engine process on the same device.
            ranks_per_node, gpus_per_rank, infer_gpus_per_node = c.gpus_per_node, 0.5, 0.5 * c.gpus_per_node
        elif shared:
            if c.gpus_per_node < 2:
                raise PlanError("a 1-node GPU run needs at least 2 GPUs (one trains, one serves), "
                                "or cluster.colocate=true to share one GPU")
            ranks_per_node, gpus_per_rank = c.gpus_per_node // 2, 1.0
            infer_gpus_per_node = float(c.gpus_per_node - ranks_per_node)
        else:
            ranks_per_node, gpus_per_rank, infer_gpus_per_node = c.gpus_per_node, 1.0, float(c.gpus_per_node)
    else:
        ranks_per_node, gpus_per_rank, infer_gpus_per_node = c.cpu_trainer_ranks, 0.0, 0.0
    world = ranks_per_node * train_nodes

    layout = _resolve_layout(cfg, arch, world, ranks_per_node, gpu)
    engines = _resolve_engines(cfg, arch, engine_kind, 0 if shared else train_nodes, infer_nodes,
                               infer_gpus_per_node, shared)
    if shared:
        roles = [NodeRole(0, "train+inference", c.gpus_per_node)]
    else:
        roles = [NodeRole(i, "train", c.gpus_per_node) for i in range(train_nodes)]
        roles += [NodeRole(train_nodes + i, "inference", c.gpus_per_node) for i in range(infer_nodes)]
    plan = RunPlan(
        model=arch.name, hardware=c.hardware, num_nodes=c.num_nodes, gpus_per_node=c.gpus_per_node,
        train_nodes=train_nodes, inference_nodes=infer_nodes, backend=backend, engine_kind=engine_kind,
        layout=layout, ranks_per_train_node=ranks_per_node, gpus_per_rank=gpus_per_rank,
        max_tokens_per_gpu=cfg.train.parallel.max_tokens_per_gpu, engines=engines, node_roles=roles,
        weight_transport=_resolve_transport(cfg, engine_kind, shared, c.colocate), colocated=c.colocate,
        serves_fp8=engine_kind == "sglang" and cfg.rollout.sglang.quantization == "fp8",
        weight_sync_fp8=cfg.rollout.weight_sync_fp8,
    )
    if check_runnable:
        check_plan_runnable(plan)
    return plan


def check_plan_runnable(plan: RunPlan) -> None:
    """Refuse what the trainer backend or the weight transport of `plan` cannot run (their own
    capability tables say; the planner repeats none of their rules)."""
    from agentrl.sync.transport import transport_refusal
    from agentrl.train.capabilities import backend_refusal

    device = "cuda" if plan.gpus_per_rank else "cpu"
    why = backend_refusal(plan.backend, plan.layout, device)
    if why is None:
        why = transport_refusal(plan.weight_transport, plan.engine_kind, plan.colocated,
                                trainer_ranks=plan.layout.world, serves_fp8=plan.serves_fp8,
                                fp8_updates=plan.weight_sync_fp8)
    if why is not None:
        raise PlanError(why)


def _resolve_layout(cfg: RunConfig, arch: ModelArch, world: int, gpus_per_node: int, gpu: bool) -> Layout:
    p = cfg.train.parallel
    fixed = {k: getattr(p, k) for k in ("tp", "pp", "cp", "ep") if getattr(p, k) is not None}
    dims = _default_dims(arch, world, gpus_per_node, fixed) if gpu else {"tp": 1, "pp": 1, "cp": 1, "ep": 1, **fixed}
    if gpu and dims["tp"] > gpus_per_node:
        raise PlanError(f"train.parallel.tp={dims['tp']} exceeds the {gpus_per_node} GPUs of a node; "
                        "TP must stay inside a node")
    try:
        sizes = _resolve_split(cfg, arch, dims["pp"])
        return Layout.resolve(world=world, tp=dims["tp"], pp=dims["pp"], cp=dims["cp"], ep=dims["ep"], etp=p.etp,
                              pp_split=sizes, num_layers=arch.num_layers, num_heads=arch.num_attention_heads,
                              n_experts=arch.n_routed_experts, sequence_parallel=p.sequence_parallel)
    except LayoutError as e:
        raise PlanError(str(e)) from None


def _resolve_split(cfg: RunConfig, arch: ModelArch, pp: int) -> list[int]:
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
        check_split(arch, sizes)
        return sizes
    except PipelineSplitError as e:
        raise PlanError(str(e)) from None


def _resolve_transport(cfg: RunConfig, engine_kind: str, shared: bool, colocate: bool) -> str:
    t = cfg.rollout.weight_transport
    if t != "auto":
        return t
    if colocate:
        return "cuda_ipc"  # trainer and engine on one GPU: handles to the trainer's own tensors, no copy
    if engine_kind == "embedded":
        return "http_tensors"  # the embedded engine reads safetensors bytes/files over its HTTP API
    return "nccl"


def engine_model_path(cfg: RunConfig, kind: str) -> str:
    """What an engine loads. Never the Megatron torch_dist folder (SGLang cannot read it): the
    node-local copy of the rollout checkpoint, else the rollout checkpoint, else the HF folder;
    the embedded engine also takes a named model."""
    m = cfg.model
    for p in (m.rollout_local_dir, m.rollout_path, m.path):
        if p is not None:
            return str(p)
    return m.name if kind == "embedded" else "<model.rollout_path>"


def _resolve_engines(cfg, arch, kind, first_node, infer_nodes, gpus_per_node: float, shared) -> list[EngineSpec]:
    model_path = engine_model_path(cfg, kind)
    if kind == "embedded":
        e = cfg.rollout.embedded
        # On a CPU machine (or beside a colocated trainer) every embedded engine shares its node;
        # with several inference nodes they are dealt round robin.
        per_engine_gpus = gpus_per_node / e.num_engines if gpus_per_node else 0.0
        return [EngineSpec(index=i, kind="embedded", nodes=[first_node + (i % infer_nodes)],
                           gpus_per_node=per_engine_gpus, port=e.base_port + i if e.base_port else 0,
                           model_path=model_path)
                for i in range(e.num_engines)]
    s = cfg.rollout.sglang
    per = s.gpus_per_engine
    whole = int(gpus_per_node)
    if cfg.cluster.colocate:
        n = cfg.cluster.gpus_per_node
        if per != n:
            raise PlanError(f"a colocated engine spans every GPU of the node: set rollout.sglang.gpus_per_engine={n}")
        return [EngineSpec(0, "sglang", [0], gpus_per_node, s.base_port, model_path, dict(s.env))]
    if per <= whole:
        if whole % per:
            raise PlanError(
                f"rollout.sglang.gpus_per_engine={per} does not divide the {whole} GPUs an inference node offers"
            )
        per_node, span = whole // per, 1
    else:
        if per % whole or shared:
            raise PlanError(
                f"an engine of {per} GPUs is wider than a node of {whole}; it must span whole nodes "
                f"(set rollout.sglang.gpus_per_engine to a divisor or multiple of {whole})"
            )
        per_node, span = 0, per // whole
    engines: list[EngineSpec] = []
    if span == 1:
        slots = [(first_node + n, k) for n in range(infer_nodes) for k in range(per_node)]
        for i, (node, k) in enumerate(slots):
            # Engines sharing a node need distinct HTTP ports (SGLang derives its internal ports from it).
            engines.append(EngineSpec(i, "sglang", [node], float(per), s.base_port + 10 * k, model_path, dict(s.env)))
    else:
        if infer_nodes % span:
            raise PlanError(f"{infer_nodes} inference nodes cannot hold engines spanning {span} nodes each")
        for i in range(infer_nodes // span):
            nodes = list(range(first_node + i * span, first_node + (i + 1) * span))
            engines.append(EngineSpec(i, "sglang", nodes, float(whole), s.base_port, model_path, dict(s.env)))
    if not engines:
        raise PlanError("the plan has no inference engine; add inference nodes or GPUs")
    return engines
