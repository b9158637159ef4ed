"""The one config tree.

Every knob is one typed field with one default. YAML recipes in configs/ and `--set a.b=c`
overrides map onto this tree; actors receive the resolved tree, never flag strings.
Secrets are never fields: the process that needs a key reads it from its own environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from agentrl.secrets import check_no_secret_keys

Hardware = Literal["H200", "B200", "GB300", "cpu"]


class Section(BaseModel):
    """Base of every section: unknown keys are errors, assignments are validated."""

    # allow_inf_nan=False: an infinite learning rate or a NaN temperature is an error here, not a NaN run.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ClusterConfig(Section):
    num_nodes: int = Field(1, ge=1, description="Nodes in the Ray cluster (training + inference).")
    gpus_per_node: int = Field(0, ge=0, description="GPUs per node; 0 means a CPU-only run.")
    hardware: Hardware = Field("cpu", description="Accelerator type; H200, B200, GB300 or cpu.")
    train_nodes: int | None = Field(
        None, ge=1, description="Nodes given to training; default: half the cluster (all of a 1-node run)."
    )
    ray_address: str | None = Field(
        None, description="Attach to this Ray cluster (head host:port; default: $RAY_ADDRESS); None starts a local one.")
    ray_auth: Literal["token", "disabled"] = Field(
        "token", description="Ray token authentication when attaching to a cluster (the token from RAY_AUTH_TOKEN, "
        "RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token, never a config). A local Ray on 127.0.0.1 runs without.")
    simulate_nodes: bool = Field(
        False, description="CPU runs: start one local raylet per plan node (127.0.0.1, role resources per node), so "
        "a multi-node plan runs on one machine through the same placement code.")
    host: str = Field(
        "127.0.0.1", description="Bind address of the dashboard, engines and servers: an address, or \"node_ip\" for "
        "each node's own IP (multi-node runs); engines advertise the node IP unless bound to a specific address.")
    dashboard_port: int = Field(8265, ge=1, le=65535)
    num_cpus: int | None = Field(None, ge=1, description="Logical CPUs of a local Ray; default: max(4, cores).")
    dashboard: bool = Field(True, description="Start Ray's dashboard (local Ray only).")
    metrics_export_port: int | None = Field(
        None, ge=1, le=65535, description="Port of the local Ray's Prometheus endpoint (agentrl_* series); None: Ray's choice."
    )
    episode_workers: int = Field(1, ge=1, description="EpisodeWorker actors; each runs many episodes at once on "
                                 "one Python process (the gpu_smollm2 loop on a 16-core machine: 4.0 episodes/s "
                                 "with 1 worker, 16.2 with 4); give a many-core machine several.")
    cpu_trainer_ranks: int = Field(
        1, ge=1, description="CPU runs: trainer processes per training node (one rank each, gloo). The torch "
        "backend runs one; the Megatron backend splits the model over train.parallel across them.")
    colocate: bool = Field(
        False, description="One-node GPU run: the trainer and the engines share every GPU (half each in Ray's "
        "accounting). For a smoke run on one GPU; fully async then competes for the device.")


class ParallelConfig(Section):
    """Megatron parallel layout of the trainer. None means: let the planner choose."""

    tp: int | None = Field(None, ge=1, description="Tensor parallel size.")
    pp: int | None = Field(None, ge=1, description="Pipeline parallel size.")
    cp: int | None = Field(None, ge=1, description="Context parallel size.")
    ep: int | None = Field(None, ge=1, description="Expert parallel size.")
    etp: int = Field(1, ge=1, description="Expert tensor parallel size.")
    sequence_parallel: bool = True
    pp_first_stage_layers: int | None = Field(None, ge=1, description="Layers in the first PP stage.")
    pp_last_stage_layers: int | None = Field(None, ge=1, description="Layers in the last PP stage.")
    pp_layer_split: list[int] | None = Field(
        None, description="Explicit layers per PP stage (overrides first/last); must sum to the model depth."
    )
    recompute: Literal["none", "full"] = "full"
    max_tokens_per_gpu: int = Field(8192, ge=1)
    cp_comm: Literal["allgather", "p2p"] = "allgather"


class OptimizerConfig(Section):
    lr: float = Field(1e-6, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.98, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    grad_clip: float = Field(1.0, gt=0)
    offload: Literal["none", "cpu", "disk"] = Field(
        "none", description="Where Adam state lives: GPU/host memory, pinned host, or node-local disk."
    )
    offload_dir: Path = Field(Path("/tmp/agentrl-optim"), description="Node-local directory for disk offload.")
    offload_bucket_mb: int = Field(256, ge=1)


class TrainConfig(Section):
    backend: Literal["auto", "torch", "megatron"] = Field(
        "auto", description="auto: megatron on GPU hardware, torch on cpu."
    )
    parallel: ParallelConfig = ParallelConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    max_steps: int = Field(100, ge=1, description="Optimizer steps before the run stops cleanly.")
    micro_batch_tokens: int = Field(4096, ge=1, description="Token budget of one micro-batch.")
    logprob_chunk_tokens: int = Field(16384, ge=1, description="Tokens per chunk when computing log-probs.")
    checkpoint_every: int = Field(10, ge=1)
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    trainable_layers: int | None = Field(
        None, ge=1, description="Train only the top N transformer layers and the final norm (embeddings and the "
        "LM head stay frozen); None trains every parameter. Cuts the backward pass on small CPU runs.")
    dsa_kernels: bool = Field(
        False, description="Megatron backend: DSA top-k and sparse attention through kernels/ (Triton) "
        "instead of Megatron's dense unfused path (agentrl.models.megatron_dsa_switch).")


class AlgorithmConfig(Section):
    """GRPO with truncated importance sampling (recipe defaults)."""

    group_size: int = Field(8, ge=1, description="Samples per prompt (GRPO group).")
    prompts_per_step: int = Field(8, ge=1, description="Groups per optimizer step.")
    eps_clip: float = Field(0.2, ge=0)
    eps_clip_high: float = Field(0.28, ge=0)
    use_tis: bool = True
    tis_clip_low: float = Field(0.5, ge=0)
    tis_clip: float = Field(2.0, gt=0)
    kl_coef: float = Field(0.0, ge=0)
    # Small-signal RL (issue G): see agentrl/train/loss.py and agentrl/policy/dynamic_sampling.py.
    advantage_norm: Literal["std", "none"] = Field(
        "std", description="std: GRPO's (r - mean) / std per group; none: r - mean (Dr. GRPO, Liu et al. 2025), "
        "which does not inflate groups whose rewards barely differ.")
    dynamic_sampling: bool = Field(
        False, description="Leave groups whose rewards are all equal (no gradient) out of the batch and replace "
        "them with new groups (DAPO's dynamic sampling).")
    dynamic_sampling_max_skips: int = Field(
        32, ge=0, description="Zero-variance groups dropped in a row before one is let through, so a run whose "
        "tasks are all failed (or all solved) still steps.")
    stale_tokens: Literal["mask", "tis"] = Field(
        "mask", description="With rollout.partial, what the loss does with a token older than buffer.max_staleness "
        "(a group trains while its newest token is within the bound): mask leaves it out, tis keeps it with its "
        "truncated importance weight (needs use_tis).")


class SGLangConfig(Section):
    """Options passed to `sglang.launch_server` (SGLang 0.5.23 flag names); one field per flag."""

    python: str = Field(
        "python", description="The interpreter SGLang is installed in (it pins its own torch), e.g. "
        "/opt/sglang/bin/python; engines run `{python} -m sglang.launch_server ...`.")
    gpus_per_engine: int = Field(4, ge=1, description="GPUs of one engine (its tp size).")
    mem_fraction_static: float = Field(0.85, gt=0, le=1)
    ep_size: int | None = Field(None, ge=1, description="Expert parallel size; default: the engine's world size.")
    enable_dp_attention: bool = True
    dp_size: int | None = Field(None, ge=1, description="Default: the engine's world size when dp-attention is on.")
    moe_dense_tp_size: int | None = 1
    enable_dp_lm_head: bool = True
    kv_cache_dtype: Literal["auto", "fp8_e4m3", "bf16"] = "fp8_e4m3"
    quantization: Literal["none", "fp8"] = "fp8"
    page_size: int = Field(64, ge=1)
    max_running_requests: int = Field(512, ge=1)
    watchdog_timeout: int = Field(3600, ge=1)
    attention_backend: str = "dsa"
    dsa_prefill_backend: str = "flashmla_sparse"
    dsa_decode_backend: str = "flashmla_kv"
    moe_a2a_backend: Literal["none", "deepep"] = "deepep"
    deepep_mode: Literal["auto", "normal", "low_latency"] = "auto"
    base_port: int = Field(30000, ge=1, le=65535)
    extra_args: list[str] = Field(default_factory=list, description="Appended verbatim to the command.")
    env: dict[str, str] = Field(
        default_factory=lambda: {"SGLANG_NSA_FORCE_MLA": "1", "INDEXER_ROPE_NEOX_STYLE": "0", "NVSHMEM_DISABLE_NCCL": "1"}
    )

    @field_validator("env")
    @classmethod
    def _no_secrets(cls, v: dict[str, str]) -> dict[str, str]:
        check_no_secret_keys(v, "rollout.sglang.env")
        return v


class EmbeddedEngineConfig(Section):
    """The CPU engine that speaks SGLang's HTTP API."""

    num_engines: int = Field(1, ge=1)
    base_port: int = Field(31000, ge=0, le=65535, description="0 picks free ports.")
    max_batch_size: int = Field(32, ge=1)
    torch_threads: int | None = Field(None, ge=1)
    prefix_cache_tokens: int = Field(
        262144, ge=0, description="Tokens of finished requests' KV kept for prefix reuse (embedded engine)."
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Weights and activations of the embedded engine (bfloat16 halves memory on a GPU).")
    static_decode_len: int = Field(
        0, ge=0, description="KV columns of the embedded engine's static decode buffers "
        "(rollout/embedded/graphs.py): its decode steps then replay CUDA graphs on a GPU, where eager decode is "
        "bound by Python and kernel launches. Memory: max_batch_size x this x the model's KV bytes per token, on top "
        "of the running cache. 0 decodes eagerly; longer batches fall back to eager steps.")
    admit_wait_steps: int = Field(
        0, ge=0, description="Decode steps that requests arriving while a batch runs may gather, so that their "
        "prefills share one forward (rollout/embedded/admission.py): a prefill forward costs about the same "
        "whatever its rows on a host-bound GPU engine. 0 admits at once.")
    weight_update_timeout_s: float = Field(
        120.0, gt=0, description="Bound on every weight-update rendezvous and broadcast of the embedded engine "
        "(/init_weights_update_group to a dead trainer fails after this, instead of hanging).")


class RolloutConfig(Section):
    @model_validator(mode="before")
    @classmethod
    def _partial_pauses_with_abort(cls, data: object) -> object:
        """Partial rollout continues aborted generations itself: its engines pause with abort (retract would
        keep the requests inside the engine, in_place would mix old KV with new weights)."""
        if isinstance(data, dict) and data.get("partial"):
            mode = data.get("pause_mode", "abort")
            if mode != "abort":
                raise ValueError(f"rollout.partial=true continues aborted generations: rollout.pause_mode must be "
                                 f"abort (got {mode!r}); drop the pause_mode setting or set it to abort")
            data = {**data, "pause_mode": "abort"}
        return data

    engine: Literal["auto", "sglang", "embedded"] = Field("auto", description="auto: sglang on GPUs, else embedded.")
    sglang: SGLangConfig = SGLangConfig()
    embedded: EmbeddedEngineConfig = EmbeddedEngineConfig()
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(8192, ge=1, description="Tokens one turn may generate.")
    pause_mode: Literal["retract", "abort", "in_place"] = Field(
        "retract", description="How engines pause for a weight update; in_place mixes old KV with new weights."
    )
    partial: bool = Field(
        False, description="Partial rollout: a weight update aborts in-flight generations (pause_mode abort, the "
        "default then), each episode keeps their tokens and re-issues the turn on the new weights for the rest of "
        "its token budget; the staleness bound then applies per token (algorithm.stale_tokens).")
    partial_lead_steps: int = Field(
        0, ge=0, description="With rollout.partial: optimizer steps of groups admission may start beyond the "
        "staleness capacity (policy/admission.py). More episodes in flight for an engine whose decode rate grows "
        "with its batch; more tokens past buffer.max_staleness (masked or TIS-corrected, counted as stale_tokens).")
    request_timeout_s: float = Field(600.0, gt=0)
    engine_start_timeout_s: float = Field(
        1800.0, gt=0, description="How long an engine may take to answer /health_generate after its process "
        "starts (SGLang loading GLM-5.2 from node-local disk takes minutes).")
    engine_max_restarts: int = Field(
        5, ge=0, description="Restarts of one engine (all its nodes, backoff 1, 2, 4, ... s) before the run stops "
        "with an error; the count starts again after the engine has run for 10 minutes.")
    weight_transport: Literal["auto", "http_tensors", "nccl", "cuda_ipc"] = Field(
        "auto", description="How weights reach the engines. auto: cuda_ipc for an engine colocated with the trainer "
        "on one GPU, http_tensors for other embedded engines, nccl (one group per pipeline stage) otherwise.")
    weight_sync_fp8: bool = Field(
        False, description="Send projection weights to engines as FP8 e4m3 + 128x128-block weight_scale_inv "
        "(DeepSeek FP8 checkpoint naming; half the bytes): exactly the tensors the rollout checkpoint "
        "(model.rollout_path, `prepare --fp8`) holds in FP8. The embedded engine dequantises on receipt.")
    weight_bucket_mb: int = Field(
        256, ge=1, description="Bytes per weight-update bucket (MiB); 256 MiB broadcasts at ~360 GB/s between two "
        "H200s (bench/results/megatron.json).")


class AgentConfig(Section):
    action_format: Literal["bash_block", "terminus_json", "text"] = "bash_block"
    max_turns: int = Field(30, ge=1)
    max_context_tokens: int = Field(32768, ge=1)
    observation_max_chars: int = Field(4000, ge=1)
    episode_timeout_s: float = Field(3600.0, gt=0)
    command_timeout_s: float = Field(60.0, gt=0)
    # Per-turn tokens are rollout.max_new_tokens; these bound the episode (agentrl/agent/episode.py).
    max_generated_tokens: int | None = Field(
        None, ge=1, description="Tokens the model may generate over a whole episode (all turns); reaching it ends "
        "the episode as truncated. None: only max_turns x rollout.max_new_tokens and max_context_tokens bound it.")
    truncated_reward: Literal["test", "zero"] = Field(
        "test", description="What a truncated episode (context or token budget reached) scores: test runs the "
        "task's tests (its state may already solve the task); zero gives reward 0 without running them.")


class GeneratedTasksConfig(Section):
    """A task set built by envs/tbench2/generate into a cache (~/.cache/agentrl/tasks/<hash>), the same
    bytes for the same fields; it takes the place of env.tasks_dir."""

    families: list[str] | None = Field(
        None, description="Families to train on (the whole set is training); None: the repo's held-out splits "
        "(envs/tbench2/generate/SPLITS.json): training families, held-out families as the eval split, held-out "
        "instances as the eval_instances split.")
    instances: int = Field(8, ge=1, description="Instances per training family.")
    seed: int = Field(0, description="Seed of the training instances (the held-out sets have their own fixed seeds).")
    cache_dir: Path | None = Field(None, description="Default: $XDG_CACHE_HOME/agentrl/tasks, else ~/.cache/agentrl/tasks.")


class CurriculumConfig(Section):
    """Which training task each new group plays (agentrl/policy/curriculum.py)."""

    sampler: Literal["round_robin", "pass_rate"] = Field(
        "round_robin", description="round_robin: every task in turn; pass_rate: by difficulty band of each task's "
        "pass rate (prime-rl's DifficultyPoolSampler idea).")
    ema: float = Field(0.5, gt=0, le=1, description="Weight of a group's mean reward in its task's pass rate "
                       "(1: the latest group only).")
    hard_below: float = Field(0.25, ge=0, le=1, description="Pass rate under which a task is hard.")
    easy_above: float = Field(0.75, ge=0, le=1, description="Pass rate over which a task is easy.")
    hard_weight: float = Field(0.2, ge=0, description="Share of groups drawn from the hard band.")
    normal_weight: float = Field(0.7, ge=0, description="Share from the normal band (and tasks not tried yet).")
    easy_weight: float = Field(0.1, ge=0, description="Share from the easy band.")

    @model_validator(mode="after")
    def _bands(self) -> CurriculumConfig:
        if self.hard_below >= self.easy_above:
            raise ValueError(f"env.curriculum.hard_below ({self.hard_below}) must be below easy_above ({self.easy_above})")
        if self.hard_weight + self.normal_weight + self.easy_weight <= 0:
            raise ValueError("env.curriculum: hard_weight, normal_weight and easy_weight cannot all be 0")
        return self


class EnvConfig(Section):
    name: str = Field("tbench2", description="Entry point name in the `agentrl.envs` group.")
    tasks_dir: Path | None = Field(None, description="Folder of task folders; default: the project's fixtures.")
    train_tasks: list[str] | None = Field(None, description="Task ids to train on; default: all but eval.")
    eval_tasks: list[str] = Field(default_factory=list)
    eval_every: int = Field(10, ge=0, description="Evaluate every N steps; 0 disables.")
    eval_samples: int = Field(1, ge=1)
    kwargs: dict[str, object] = Field(default_factory=dict, description="Passed to the env's constructor.")
    generate: GeneratedTasksConfig | None = Field(
        None, description="Build the tasks with envs/tbench2/generate instead of reading tasks_dir (tbench2 env).")
    curriculum: CurriculumConfig = CurriculumConfig()

    @field_validator("kwargs")
    @classmethod
    def _no_secrets(cls, v: dict[str, object]) -> dict[str, object]:
        check_no_secret_keys(v, "env.kwargs")
        return v

    @model_validator(mode="after")
    def _one_task_source(self) -> EnvConfig:
        if self.generate is not None and self.tasks_dir is not None:
            raise ValueError("env.generate and env.tasks_dir both set: a generated set replaces tasks_dir; drop one")
        return self


class SandboxConfig(Section):
    backend: Literal["local", "daytona"] = "local"
    max_concurrent_creates: int = Field(
        8, ge=1, description="Sandbox creates in flight at once, per episode worker: Daytona's API quota, and for "
        "local sandboxes a bound on concurrent mkfs + mount + bwrap start-ups. An episode waiting for a slot counts "
        "in its env time (at 64 episodes on 2 cores, 8 -> 64 halved env_s but moved the wait to the tests: "
        "bench/episode_host.py).")
    creates_per_minute: int = Field(120, ge=1)
    retry_backoff_min_s: float = Field(2.0, ge=0)
    retry_backoff_max_s: float = Field(30.0, ge=0)
    max_create_attempts: int = Field(8, ge=1)
    create_timeout_s: float = Field(600.0, gt=0)
    keepalive_s: float = Field(300.0, gt=0)
    min_cpus: int = Field(1, ge=1)
    min_memory_mb: int = Field(2048, ge=1)
    min_disk_mb: int = Field(10240, ge=1)
    auto_delete_minutes: int = Field(240, ge=1)
    daytona_api_url: str | None = Field(None, description="Default: $DAYTONA_API_URL. The key is read from $DAYTONA_API_KEY only.")
    daytona_target: str | None = None
    local_allow_network: bool = False
    local_memory_mb: int = Field(2048, ge=64)
    local_cpu_seconds: int = Field(600, ge=1)


class BufferConfig(Section):
    max_staleness: int = Field(4, ge=0, description="Max version lag of a group's oldest token at training time.")
    stale_policy: Literal["drop", "regenerate"] = "regenerate"
    cancel_stale_groups: bool = Field(
        True, description="Without partial rollout: cancel a running group as soon as its oldest known token is "
        "past max_staleness (it could never train; agentrl/policy/stale_cancel.py), freeing its engine time and "
        "admission slots; it is retired as stale_cancelled_lag_<k> and, like a stale group, handled by stale_policy. "
        "Off: such a group runs to the end and is retired when it completes (what runs did before).")
    max_episodes_in_flight: int = Field(128, ge=1)
    fsync: bool = Field(True, description="fsync the log before acknowledging a trajectory.")
    resume_in_flight: bool = Field(
        False, description="Record each running episode's progress (tokens, versions, actions, observations) "
        "durably at every turn and interruption (partial.log.jsonl beside the replay log) and continue those "
        "episodes after a restart instead of starting their groups again (rule and limits: agentrl/agent/resume.py).")


class LoggingConfig(Section):
    run_dir: Path = Path("runs/latest")
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    transcripts: bool = True
    wandb_project: str | None = None
    wandb_entity: str | None = Field(None, description="W&B entity (team or user); None: the key's default.")
    wandb_mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="W&B mode; None: WANDB_MODE from the environment, else online.")
    tensorboard: bool = False


class ModelConfig(Section):
    name: str = Field("tiny", description="A named model (GLM-5.2, GLM-5.2_5layer, tiny, smollm2-135m, gemma3-270m) or a path.")
    path: Path | None = Field(None, description="HF checkpoint folder; default: the named model's own source.")
    megatron_dir: Path | None = Field(None, description="Converted torch_dist checkpoint (shared storage).")
    local_dir: Path | None = Field(None, description="Node-local copy made by prepare-cp.")
    rollout_path: Path | None = Field(
        None, description="Checkpoint the engines load: an HF folder, or a pre-converted FP8 HF checkpoint; "
        "default: model.path. Never the torch_dist folder (SGLang cannot read it).")
    rollout_local_dir: Path | None = Field(
        None, description="Node-local copy of rollout_path made by prepare-cp on inference nodes; engines load "
        "it when set.")


class RunConfig(Section):
    """The whole run. `agentrl.config.load_config` builds it from a recipe and overrides."""

    recipe: str = Field("local", description="Name of the recipe this tree came from.")
    mode: Literal["async", "sync"] = "async"
    seed: int = 0
    cluster: ClusterConfig = ClusterConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    rollout: RolloutConfig = RolloutConfig()
    agent: AgentConfig = AgentConfig()
    env: EnvConfig = EnvConfig()
    sandbox: SandboxConfig = SandboxConfig()
    buffer: BufferConfig = BufferConfig()
    logging: LoggingConfig = LoggingConfig()

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        """Contradictions between sections that no single field can catch (each a hang or a wasted run)."""
        a, r, ag, b = self.algorithm, self.rollout, self.agent, self.buffer
        if a.use_tis and a.tis_clip_low > a.tis_clip:
            raise ValueError(f"algorithm.tis_clip_low={a.tis_clip_low} exceeds algorithm.tis_clip={a.tis_clip}; "
                             "the TIS weight would be clamped to an empty range")
        if b.max_episodes_in_flight < a.group_size:
            raise ValueError(f"buffer.max_episodes_in_flight={b.max_episodes_in_flight} is below "
                             f"algorithm.group_size={a.group_size}: no group could ever start (the run would hang)")
        if r.partial_lead_steps and not r.partial:
            raise ValueError(f"rollout.partial_lead_steps={r.partial_lead_steps} admits groups beyond the staleness "
                             "capacity, which only partial rollout can train (per-token bound); set rollout.partial="
                             "true or partial_lead_steps=0")
        if r.partial and a.stale_tokens == "tis" and not a.use_tis:
            raise ValueError("algorithm.stale_tokens=tis corrects stale tokens with their TIS weight, but "
                             "algorithm.use_tis is false; turn use_tis on or use stale_tokens=mask")
        if r.max_new_tokens >= ag.max_context_tokens:
            raise ValueError(f"rollout.max_new_tokens={r.max_new_tokens} does not fit agent.max_context_tokens="
                             f"{ag.max_context_tokens}: no turn could be generated; lower it below the context")
        return self
