"""Cross-field checks of a resolved recipe: ranges, shapes, batch arithmetic, the parallel
layout's rules (`fsdprun.config.layout`, for the model's facts: `fsdprun.config.model_facts`),
string and path keys by kind, trackers and profiling. `validate` returns every problem as one
line each, so they are shown together.

The data files themselves are checked by `fsdprun.data.preflight.check_data`, which the
commands that use them call (`fsdprun config`, the launchers): the data package depends on
config, never the reverse. Never imports torch at module level, nor fsdprun.data/train/launch,
nor fsdprun.models (which reads config; family names come from `fsdprun.families`);
torch (through fsdprun.device) only to resolve launch.device=auto on a machine with accelerator
device nodes.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import glob
import importlib.util
import math
import re
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from fsdprun.config.layout import Layout, layout_errors
from fsdprun.config.model_facts import model_facts
from fsdprun.config.plain_yaml import load_yaml
from fsdprun.config.schema import (
    CHAT_ROLES,
    TUNE_KNOBS,
    TUNE_NUMERICS_KNOBS,
    CheckpointMode,
    DataSource,
    DeviceKind,
    Dtype,
    Engine,
    Float8,
    OptimImpl,
    ProfileConfig,
    RecipeConfig,
    WrapPolicy,
    from_auto,
)
from fsdprun.families import family_problem
from fsdprun.report.trackers import tracker_errors

# Keys whose value must be > 0, and keys whose value must be >= 0 (both finite).
POSITIVE_KEYS = (
    "model.dim", "model.n_layers", "model.n_heads", "model.ffn_dim", "model.vocab_size",
    "model.max_seq_len", "model.rope_theta", "model.norm_eps", "optim.lr", "optim.eps",
    "train.steps", "train.global_batch_size", "train.micro_batch_size", "train.seq_len",
    "launch.nproc_per_node", "launch.nnodes", "output.log_every", "fsdp.min_num_params",
    "launch.rdzv_timeout_s", "launch.timeout_s", "eval.batches", "data.max_line_bytes",
    "launch.monitor_interval_s",
)  # fmt: skip
NON_NEGATIVE_KEYS = (
    "optim.weight_decay", "train.grad_clip", "schedule.warmup_steps", "launch.max_restarts",
    "launch.node_rank", "fsdp.forward_prefetch", "checkpoint.every_steps", "checkpoint.keep_last",
    "train.max_skipped", "output.timing_warmup_steps", "train.seed", "eval.every_steps",
)  # fmt: skip


def validate(cfg: RecipeConfig, *, world_size: int | None = None) -> list[str]:
    """Checks that span keys; returns one message per problem (empty when valid).

    Bounds and string keys come first: the other checks divide by and compare these values.
    """
    errors = _bound_errors(cfg) + _string_errors(cfg)
    if errors:
        return errors
    return _recipe_errors(cfg, world_size if world_size is not None else cfg.world_size)


def _bound_errors(cfg: RecipeConfig) -> list[str]:
    errors = []
    for keys, bound, ok in ((POSITIVE_KEYS, "> 0", lambda v: v > 0),
                            (NON_NEGATIVE_KEYS, ">= 0", lambda v: v >= 0)):  # fmt: skip
        for key in keys:
            section, leaf = key.split(".")
            value = getattr(getattr(cfg, section), leaf)
            if not (ok(value) and math.isfinite(value)):  # NaN fails every comparison
                errors.append(f"{key} must be {bound} (got {value})")
    return errors


def _model_errors(cfg: RecipeConfig) -> list[str]:
    m, t = cfg.model, cfg.train
    errors = []
    n_kv = m.n_kv_heads if m.n_kv_heads is not None else m.n_heads
    if m.dim % m.n_heads:
        errors.append(f"model.dim ({m.dim}) must be divisible by model.n_heads ({m.n_heads})")
    elif (m.dim // m.n_heads) % 2:
        errors.append(f"model.dim / model.n_heads ({m.dim // m.n_heads}) must be even for RoPE")
    if n_kv <= 0 or m.n_heads % n_kv:
        errors.append(
            f"model.n_heads ({m.n_heads}) must be a multiple of model.n_kv_heads ({n_kv})"
        )
    if (problem := family_problem(m.family, m.hf_path)) is not None:
        errors.append(problem)
    if m.hf_path is None:
        errors += _moe_errors(m)
    if m.hf_path is not None:
        if not (Path(m.hf_path) / "config.json").is_file():
            errors.append(f"model.hf_path: {m.hf_path} has no config.json (a HuggingFace folder?)")
        elif (facts := model_facts(m)) and facts.remote_code and not m.trust_remote_code:
            # transformers would run the folder's Python (or, on a terminal, ask first: a rank
            # must never wait for an answer).
            errors.append(
                f"model.hf_path: {m.hf_path} ships its own model code for model_type "
                f"{facts.model_type!r} (config.json's auto_map); fsdprun runs it only with "
                "model.trust_remote_code=true"
            )
        # find_spec only looks the package up: the check stays fast without importing it.
        if importlib.util.find_spec("transformers") is None:
            errors.append("model.hf_path needs transformers: pip install 'fsdprun[hf]'")
    elif t.seq_len > m.max_seq_len:
        errors.append(
            f"train.seq_len ({t.seq_len}) exceeds model.max_seq_len ({m.max_seq_len}); "
            "raise model.max_seq_len or shorten train.seq_len"
        )
    return errors


def _moe_errors(m) -> list[str]:
    """The built-in Llama's mixture of experts (the model.moe_* keys)."""
    if m.moe_experts < 0:
        return [f"model.moe_experts must be >= 0 (got {m.moe_experts}); 0 = a dense model"]
    errors = []
    if m.moe_experts and not 1 <= m.moe_active <= m.moe_experts:
        errors.append(
            f"model.moe_active ({m.moe_active}) must be between 1 and model.moe_experts "
            f"({m.moe_experts}): the experts each token passes through"
        )
    if m.moe_ffn_dim is not None and m.moe_ffn_dim <= 0:
        errors.append(f"model.moe_ffn_dim must be > 0 (got {m.moe_ffn_dim}), or null")
    if m.moe_shared_ffn_dim < 0:
        errors.append(f"model.moe_shared_ffn_dim must be >= 0 (got {m.moe_shared_ffn_dim})")
    if not (m.moe_aux_loss_coef >= 0 and math.isfinite(m.moe_aux_loss_coef)):
        errors.append(f"model.moe_aux_loss_coef must be >= 0 (got {m.moe_aux_loss_coef})")
    return errors


def _recipe_errors(cfg: RecipeConfig, ws: int) -> list[str]:
    t = cfg.train
    errors = _model_errors(cfg)
    layout = Layout.of(cfg, ws)
    # A tp (or cp) that does not divide the world leaves no data-parallel size to count the
    # batch in: that error (the layout's) comes alone, not a batch error with made-up
    # arithmetic.
    dp = layout.dp if layout.fits_world else None
    per_step = t.micro_batch_size * (dp or 0)
    if dp is not None and t.global_batch_size % per_step:
        ranks = f"{dp}" if layout.row_group == 1 else (
            f"{dp} = world size / parallel.tp" if layout.cp == 1
            else f"{dp} = world size / (parallel.tp x parallel.cp)")  # fmt: skip
        if layout.is_pp:
            ranks = f"{dp} = world size / (parallel.pp x parallel.cp x parallel.tp)"
        errors.append(
            f"train.global_batch_size ({t.global_batch_size}) must be divisible by "
            f"train.micro_batch_size ({t.micro_batch_size}) x data-parallel ranks ({ranks}) = "
            f"{per_step}; change one of them"
        )
    if len(cfg.optim.betas) != 2 or not all(0 <= b < 1 for b in cfg.optim.betas):
        errors.append(f"optim.betas must be two numbers in [0, 1) (got {cfg.optim.betas})")
    if not 0 <= cfg.schedule.min_lr_ratio <= 1:
        errors.append(f"schedule.min_lr_ratio must be in [0, 1] (got {cfg.schedule.min_lr_ratio})")
    if cfg.schedule.warmup_steps > t.steps:
        errors.append(
            f"schedule.warmup_steps ({cfg.schedule.warmup_steps}) exceeds train.steps ({t.steps})"
        )
    errors += _fsdp_errors(cfg, ws)
    if cfg.fsdp.wrap is WrapPolicy.classes and not cfg.fsdp.wrap_classes:
        errors.append("fsdp.wrap is 'classes' but fsdp.wrap_classes is empty; list class names")
    if t.loss_chunk_size < 1:
        errors.append(f"train.loss_chunk_size must be >= 1 (got {t.loss_chunk_size})")
    if cfg.precision.float8 is not Float8.off and cfg.fsdp.engine is not Engine.fsdp2:
        errors.append(
            f"precision.float8={cfg.precision.float8.value} needs fsdp.engine=fsdp2 (got "
            f"{cfg.fsdp.engine.value}); or set precision.float8=off"
        )
    if cfg.precision.float8_all_gather and cfg.precision.float8 is Float8.rowwise:
        errors.append(
            "precision.float8_all_gather=true needs precision.float8=tensorwise (torchao gathers "
            "only tensorwise weights in float8); set precision.float8_all_gather=auto"
        )
    ac = cfg.activation_checkpointing
    if ac.mode is CheckpointMode.every_n and ac.every_n < 1:
        errors.append(f"activation_checkpointing.every_n must be >= 1 (got {ac.every_n})")
    if not 0 <= cfg.data.noise <= 1:
        errors.append(f"data.noise must be in [0, 1] (got {cfg.data.noise})")
    errors += _data_errors(cfg)
    if cfg.launch.node_rank >= cfg.launch.nnodes:
        errors.append(
            f"launch.node_rank ({cfg.launch.node_rank}) must be < launch.nnodes "
            f"({cfg.launch.nnodes})"
        )
    if cfg.launch.rdzv_endpoint and not re.fullmatch(r"[^:\s]+:\d+", cfg.launch.rdzv_endpoint):
        errors.append(f"launch.rdzv_endpoint '{cfg.launch.rdzv_endpoint}' must look like HOST:PORT")
    errors += launch_stream_errors(cfg.launch)
    if cfg.launch.device_memory_gb is not None and not cfg.launch.device_memory_gb > 0:
        errors.append(f"launch.device_memory_gb must be > 0 (got {cfg.launch.device_memory_gb})")
    if cfg.output.peak_tflops is not None and cfg.output.peak_tflops <= 0:
        errors.append(f"output.peak_tflops must be > 0 (got {cfg.output.peak_tflops})")
    errors += tracker_errors(tensorboard=cfg.output.tensorboard, wandb=cfg.output.wandb)
    errors += _profile_errors(cfg.profile, cfg.launch.device, ws)
    errors += _lora_errors(cfg)
    errors += tune_space_errors(cfg.tune.space, where="tune.space")
    return errors


def _profile_errors(p: ProfileConfig, device: DeviceKind, world_size: int) -> list[str]:
    errors = [f"profile.{key} must be >= 0 (got {getattr(p, key)})"
              for key in ("wait", "warmup") if getattr(p, key) < 0]  # fmt: skip
    if p.active < 1:
        errors.append(f"profile.active must be >= 1 (got {p.active})")
    bad = [r for r in p.ranks if not 0 <= r < world_size]
    if bad:
        errors.append(f"profile.ranks {bad} are not ranks of this run (0..{world_size - 1})")
    if p.memory_snapshot and not p.enabled:
        errors.append("profile.memory_snapshot covers the profiled steps: set profile.enabled=true")
    elif p.memory_snapshot:
        kind = device.value
        if device is DeviceKind.accelerator and not accelerator_device_nodes():
            kind = None  # refused before launch (`launch_device_problem`), not a profile problem
        elif device in (DeviceKind.auto, DeviceKind.accelerator):
            from fsdprun.device import resolve_device_kind  # imports torch: only when needed

            kind = resolve_device_kind("auto")
        if kind is not None and kind != "cuda":
            errors.append(
                "profile.memory_snapshot records the CUDA caching allocator: it is CUDA-only and "
                f"this run is on {kind} (launch.device={device.value}); set "
                "profile.memory_snapshot=false"
            )
    return errors


# Every string key (and list of strings) of the schema, with the kind of text it holds; a test
# keeps this table complete. Kinds: `name` (non-empty), `class` (a Python class name),
# `file`/`folder` (a path that must not be the other kind; existence is checked where the path
# is used), `path` (either kind), `text` (free text, control characters allowed), `endpoint`
# (HOST:PORT, checked in validate), `run_file` (a .jsonl file name inside the run directory: the
# only place fsdprun writes), `job_id` (a name without `/` that folders are named after).
STRING_KEYS: dict[str, tuple[str, str]] = {
    "model.family": ("name", "a model family (llama)"),
    "model.hf_path": ("folder", "a HuggingFace model folder, or null"),
    "fsdp.backward_prefetch": ("name", "pre, post, none or a depth >= 1"),
    "fsdp.wrap_classes": ("class", "module class names such as TransformerBlock"),
    "data.paths": ("path", "token, text or example files, or a saved dataset folder"),
    "data.val_paths": ("path", "token, text or example files, or a saved dataset folder"),
    "data.text_field": ("name", "the .jsonl field holding the text"),
    "data.tokenizer": ("path", "byte, a tokenizer.json file or a HuggingFace folder"),
    "data.prompt_field": ("name", "the field holding the prompt"),
    "data.response_field": ("name", "the field holding the response"),
    "data.template": ("text", "a text with {prompt}"),
    "data.eos_token": ("name", "a token of data.tokenizer, null (found) or none (no separator)"),
    "compile.cache_dir": ("folder", "a folder for torch's compile caches, or null"),
    "checkpoint.load_from": ("folder", "a checkpoint folder (RUN_DIR/checkpoints/step-N), or null"),
    "launch.rdzv_endpoint": ("endpoint", "HOST:PORT, or empty for one node"),
    "launch.rdzv_id": ("job_id", "a job id, the same on every node, usable in a folder name"),
    "launch.role": ("name", "a role name"),
    "launch.log_dir": ("folder", "a folder for the ranks' logs, or null for RUN_DIR/logs"),
    "launch.redirects": ("name", "0, 1, 2, 3 or LOCAL_RANK:0-3 pairs"),
    "launch.tee": ("name", "0, 1, 2, 3 or LOCAL_RANK:0-3 pairs"),
    "output.run_dir": ("folder", "a folder, or null for runs/<recipe>-<time>"),
    "output.metrics_file": ("run_file", "a .jsonl file name in the run directory (metrics.jsonl)"),
    "lora.targets": (
        "name",
        "attention, mlp, Linear layer names such as q_proj or wq, or path patterns",
    ),
}
_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")


# torch's c10d rendezvous settings (dynamic_rendezvous, c10d_rendezvous_backend): whole seconds
# or counts, or a flag, or the store's type.
RDZV_CONF_INTS = ("read_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout",
                  "keep_alive_interval", "keep_alive_max_attempt")  # fmt: skip
RDZV_CONF_KEYS = (*RDZV_CONF_INTS, "is_host", "store_type")
# torch.distributed.elastic.multiprocessing.api.Std.from_str's grammar: 0-3, or RANK:0-3,...
_STD = re.compile(r"[0-3]|\d+:[0-3](,\d+:[0-3])*")


def launch_stream_errors(launch) -> list[str]:
    """launch.redirects, launch.tee, launch.local_ranks_filter and launch.rdzv_conf as torchrun
    reads them (checked before torch loads: the agent only raises later, with a traceback)."""
    errors = []
    for key in ("redirects", "tee"):
        value = getattr(launch, key)
        if not _STD.fullmatch(value):
            errors.append(
                f"launch.{key}: {value!r} is not a stream choice; expected 0 (none), 1 (stdout), "
                "2 (stderr), 3 (both), or LOCAL_RANK:0-3 pairs such as 0:3,1:0"
            )
    bad_ranks = [r for r in launch.local_ranks_filter if not 0 <= r < launch.nproc_per_node]
    if bad_ranks:
        errors.append(
            f"launch.local_ranks_filter {bad_ranks} are not local ranks of this node "
            f"(0..{launch.nproc_per_node - 1})"
        )
    for key, value in launch.rdzv_conf.items():
        if key == "join_timeout":
            errors.append("launch.rdzv_conf: join_timeout is launch.rdzv_timeout_s; set that")
        elif key not in RDZV_CONF_KEYS:
            hint = difflib.get_close_matches(key, RDZV_CONF_KEYS, n=1)
            errors.append(
                f"launch.rdzv_conf: '{key}' is not a c10d rendezvous setting"
                + (
                    f"; did you mean '{hint[0]}'?"
                    if hint
                    else f" (they are {', '.join(RDZV_CONF_KEYS)})"
                )
            )
        elif key in RDZV_CONF_INTS and not str(value).isdigit():
            errors.append(f"launch.rdzv_conf: {key}={value!r} must be a whole number")
    return errors


def _string_problem(kind: str, value: str, run_dir: str | None) -> str | None:
    """What is wrong with one string of a STRING_KEYS kind, or None."""
    if kind == "text":  # free text: newlines and tabs belong in a template
        return None if value.strip() else "is empty"
    if _CONTROL_CHARS.search(value):
        return "contains a control character"
    if kind == "endpoint":
        port = value.rpartition(":")[2]
        return "has a port above 65535" if port.isdigit() and int(port) > 65535 else None
    if not value.strip():
        return "is empty"
    path = Path(value)
    if kind == "class" and not value.isidentifier():
        return "is not a class name"
    if kind == "job_id" and ("/" in value or value in (".", "..")):
        # It names folders: the logs' <rdzv_id>_<random>, a multi-node run's runs/<recipe>-<id>.
        return "is no folder name"
    if kind == "file" and value != "byte" and path.is_dir():
        return "is a folder"
    if kind == "folder" and path.exists() and not path.is_dir():
        return "is not a folder"
    if kind == "run_file":
        if path.is_absolute():
            return "is an absolute path"
        if ".." in path.parts:
            return "leaves the run directory"
        if path.name != value or value == ".":
            return "is not a plain file name"
        if not value.endswith(".jsonl"):
            return "does not end in .jsonl"
        if run_dir is not None and (Path(run_dir) / value).is_dir():
            return f"is a folder in {run_dir}"
    return None


def _string_errors(cfg: RecipeConfig) -> list[str]:
    """The STRING_KEYS checks: empty, wrong kind, control characters, escapes from the run
    directory. Values are quoted with repr, so every message stays one line."""
    errors = []
    for key, (kind, expected) in STRING_KEYS.items():
        section, leaf = key.split(".")
        value = getattr(getattr(cfg, section), leaf)
        for item in value if isinstance(value, list) else [value]:
            if item is None:
                continue
            problem = _string_problem(kind, str(item), cfg.output.run_dir)
            if problem:
                errors.append(f"{key}: {str(item)!r} {problem}; expected {expected}")
    return errors


def _fsdp_errors(cfg: RecipeConfig, ws: int) -> list[str]:
    f = cfg.fsdp
    errors = layout_errors(cfg, model_facts(cfg.model), world_size=ws)
    if f.engine is Engine.fsdp1 and f.cpu_offload and _runs_on_cpu(cfg.launch.device):
        # FSDP1's CPUOffload pins host memory, which needs an accelerator; FSDP2's policy can
        # leave it unpinned.
        errors.append(
            f"fsdp.cpu_offload=true with fsdp.engine=fsdp1 needs an accelerator (FSDP1 pins host "
            f"memory), but this run is on CPU (launch.device={cfg.launch.device.value}); use "
            "fsdp.engine=fsdp2 (its CPU offload works on CPU) or fsdp.cpu_offload=false"
        )
    if (
        cfg.optim.implementation is OptimImpl.fused
        and cfg.precision.param_dtype is Dtype.fp16
        and f.engine is not Engine.ddp
    ):
        errors.append(
            f"optim.implementation=fused with precision.param_dtype=fp16 under "
            f"fsdp.engine={f.engine.value}: torch's fused AdamW fails with FSDP's sharded "
            "gradient scaler; use optim.implementation=auto (foreach here) or bf16"
        )
    if f.engine is Engine.fsdp1 and not f.use_orig_params:
        if cfg.compile.enabled:
            errors.append("fsdp.use_orig_params=false does not work with compile.enabled=true")
        if cfg.optim.weight_decay > 0:
            errors.append(
                "fsdp.use_orig_params=false: flat parameters mix decayed and non-decayed "
                "tensors; set optim.weight_decay=0 or keep use_orig_params=true"
            )
    return errors


# Device nodes that accelerator drivers create: NVIDIA, WSL2's GPU bridge, AMD ROCm, Intel and
# other DRM GPUs, Ascend NPUs. Without any of them no torch build sees an accelerator.
_ACCELERATOR_NODES = ("/dev/nvidia*", "/dev/dxg", "/dev/kfd", "/dev/dri/renderD*", "/dev/davinci*")


def accelerator_device_nodes() -> list[str]:
    """The accelerator device nodes of this machine (empty: CPU only, known without torch)."""
    return sorted(p for pattern in _ACCELERATOR_NODES for p in glob.glob(pattern))


def launch_device_problem(device: DeviceKind) -> str | None:
    """A recipe for accelerators (launch.device=accelerator) on a machine without one, told
    without torch; not part of `validate`, since `plan` and `config` of such a recipe work
    anywhere. With accelerator device nodes, the launcher's device check (torch) decides."""
    if device is DeviceKind.accelerator and not accelerator_device_nodes():
        return (
            "this recipe is sized for accelerators (launch.device=accelerator) but this machine "
            "has no GPU (no cuda, npu or xpu device node in /dev); launch.device=cpu forces a "
            "CPU run (see `fsdprun plan` for its memory)"
        )
    return None


def _runs_on_cpu(device: DeviceKind) -> bool:
    """Whether launch.device means CPU ranks on this machine (`auto` without an accelerator;
    never `accelerator`, which refuses CPU before launch)."""
    if device is DeviceKind.auto:
        if not accelerator_device_nodes():
            return True  # `fsdprun config` stays torch-free on CPU machines
        from fsdprun.device import resolve_device_kind  # imports torch (~1.5 s): only here

        return resolve_device_kind(device.value) == "cpu"
    return device is DeviceKind.cpu


def _data_errors(cfg: RecipeConfig) -> list[str]:
    d = cfg.data
    errors = []
    if not 0 <= d.val_fraction < 1:
        errors.append(f"data.val_fraction must be in [0, 1) (got {d.val_fraction})")
    if d.source is DataSource.synthetic:
        if d.paths or d.val_paths:
            errors.append(
                "data.paths/data.val_paths are set but data.source is synthetic; set data.source "
                "to tokens or text"
            )
        return errors
    if not d.paths:
        errors.append(f"data.source is {d.source.value} but data.paths is empty; list the files")
    if d.val_paths and d.val_fraction:
        errors.append("set data.val_paths or data.val_fraction, not both")
    if d.source is DataSource.chat and d.tokenizer == "byte":
        errors.append(
            "data.source is chat but data.tokenizer is byte, which has no chat template; set "
            "data.tokenizer to a HuggingFace folder with tokenizer_config.json (e.g. model.hf_path)"
        )
    if d.source is DataSource.instruct and "{prompt}" not in d.template:
        errors.append(
            f"data.template {d.template!r} has no {{prompt}}; put {{prompt}} where the prompt goes"
        )
    for role, to in d.roles.items():
        if to not in CHAT_ROLES and to != role:
            errors.append(
                f"data.roles.{role}: {to!r} is not one of {', '.join(CHAT_ROLES)} (or {role!r} "
                "itself, to pass the role to the chat template as it is)"
            )
    if cfg.eval.every_steps and not (d.val_paths or d.val_fraction):
        errors.append(
            f"eval.every_steps is {cfg.eval.every_steps} but there is no validation data; set "
            "data.val_paths or data.val_fraction (or eval.every_steps=0)"
        )
    return errors


def _lora_errors(cfg: RecipeConfig) -> list[str]:
    lora = cfg.lora
    if lora.rank < 0:
        return [f"lora.rank must be >= 0 (got {lora.rank}); 0 turns LoRA off"]
    if lora.rank == 0:
        return []
    errors = []
    if not (lora.alpha > 0 and math.isfinite(lora.alpha)):
        errors.append(f"lora.alpha must be > 0 (got {lora.alpha})")
    if not 0 <= lora.dropout < 1:
        errors.append(f"lora.dropout must be in [0, 1) (got {lora.dropout})")
    if not lora.targets:
        errors.append(
            "lora.targets is empty; list Linear layers such as [attention, mlp] or [q_proj, v_proj]"
        )
    if cfg.fsdp.engine is Engine.fsdp1:
        # FSDP1 flattens a unit's frozen base weights and trainable adapters into one flat
        # parameter whose gradient and optimizer state cover the frozen part too.
        errors.append(
            f"lora.rank={lora.rank} needs fsdp.engine=fsdp2 or ddp (got fsdp1); set "
            "fsdp.engine=fsdp2"
        )
    if cfg.precision.float8 is not Float8.off:
        errors.append(
            f"lora.rank={lora.rank} does not combine with precision.float8="
            f"{cfg.precision.float8.value}; set precision.float8=off"
        )
    return errors


def tune_space_errors(space: dict[str, list[str]], *, where: str) -> list[str]:
    """The tuning space's problems (tune.space, or --space as `where`): a key that is not a
    tuning knob, a knob without values, a value its key's type refuses."""
    errors = []
    for key, values in space.items():
        if key not in TUNE_KNOBS + TUNE_NUMERICS_KNOBS:
            errors.append(
                f"{where}: {key!r} is not a tuning knob (tune never changes the model, data, "
                f"batch, lr, schedule or seed); knobs: {', '.join(TUNE_KNOBS)}; with "
                f"--allow-numerics also {', '.join(TUNE_NUMERICS_KNOBS)}"
            )
            continue
        if not values:
            errors.append(f"{where}: {key} has no values; give a list such as [v1, v2]")
            continue
        section, name = key.split(".", 1)
        kind = next(f for f in dataclasses.fields(RecipeConfig) if f.name == section)
        node = OmegaConf.structured(kind.default_factory)
        for value in values:
            typed = from_auto(key, _yaml_value(value))
            try:
                merged = getattr(OmegaConf.merge(node, {name: typed}), name)
            except Exception:  # noqa: BLE001 - omegaconf's ValidationError and its subclasses
                default = getattr(kind.default_factory(), name)
                choices = (f" (one of {', '.join(m.value for m in type(default))})"
                           if isinstance(default, enum.Enum) else "")  # fmt: skip
                errors.append(f"{where}: {key} value {value!r} is not a valid {key}{choices}")
                continue
            # The bounds every recipe must keep whatever its other keys (a candidate refused
            # only beside other values, a micro-batch that does not divide the batch, is pruned).
            bound = _VALUE_BOUNDS.get(key)
            if bound is not None and merged is not None and not (
                merged >= bound[0] and math.isfinite(merged) and merged != bound[1]
            ):  # fmt: skip
                at_least = f"> {bound[1]}" if bound[0] == bound[1] else f">= {bound[0]}"
                errors.append(f"{where}: {key} value {value!r} must be {at_least}")
    return errors


# key -> (lowest value, a value refused): the per-key bounds of _bound_errors and
# _recipe_errors, for values given without a recipe around them.
_VALUE_BOUNDS = {
    **{key: (0, 0) for key in POSITIVE_KEYS},
    **{key: (0, None) for key in NON_NEGATIVE_KEYS},
    "train.loss_chunk_size": (1, None),
    "activation_checkpointing.every_n": (1, None),
    "fsdp.shard_group_size": (1, None),
}


def _yaml_value(text: str):
    try:
        return load_yaml(str(text))
    except (yaml.YAMLError, ValueError):  # the schema then refuses the text as it is
        return text
