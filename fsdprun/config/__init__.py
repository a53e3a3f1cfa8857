"""Recipes: the typed schema (`schema`), layered loading with `extends:`, command-line
overrides and provenance (`load`), cross-field checks (`validate`), YAML read as plain data
(`plain_yaml`), the generated reference table (`reference`) and the size parser of the command
line (`sizes`).

`load_recipe("debug", ["optim.lr=1e-3"])` returns one validated `RecipeConfig` plus where each
value came from; every mistake is a `UserError` of one line. The package never imports torch
(only `validate` reaches fsdprun.device, to resolve launch.device=auto on a machine with
accelerator device nodes), nor fsdprun.data/train/launch/models (the family names are
`fsdprun.families`'), nor the engines. It owns the two facts every room asks: the parallel
layout (`layout`: every degree, the mesh's dims and the rules that refuse a layout) and the
model's facts (`model_facts`: config.json read once).
"""

from fsdprun.config.load import (
    CLI_SOURCE,
    DEFAULT_SOURCE,
    ResolvedRecipe,
    builtin_recipes,
    config_to_dict,
    dump_config,
    explain,
    load_recipe,
    parse_overrides,
)
from fsdprun.config.reference import recipe_reference
from fsdprun.config.schema import (
    CHAT_ROLES,
    TUNE_KNOBS,
    TUNE_NUMERICS_KNOBS,
    ActivationCheckpointingConfig,
    ChatTurns,
    CheckpointConfig,
    CheckpointMode,
    CompileConfig,
    CompileMode,
    CpImpl,
    DataConfig,
    DataSource,
    Decay,
    DeviceKind,
    Dtype,
    Engine,
    EvalConfig,
    Float8,
    Float8Filter,
    FsdpConfig,
    LaunchConfig,
    LoraConfig,
    LossKind,
    ModelConfig,
    ModelInit,
    NonFinite,
    OnSaveError,
    OptimConfig,
    OptimImpl,
    OutputConfig,
    ParallelConfig,
    PpSchedule,
    PrecisionConfig,
    ProfileConfig,
    RecipeConfig,
    ScheduleConfig,
    Sharding,
    TokenDtype,
    TrainConfig,
    Truncate,
    TuneConfig,
    WrapPolicy,
    schema_fields,
)
from fsdprun.config.sizes import parse_size
from fsdprun.config.validate import (
    STRING_KEYS,
    accelerator_device_nodes,
    launch_device_problem,
    validate,
)

__all__ = [
    "CHAT_ROLES", "CLI_SOURCE", "DEFAULT_SOURCE", "STRING_KEYS", "ActivationCheckpointingConfig",
    "ChatTurns", "CheckpointConfig", "CheckpointMode", "CompileConfig", "CompileMode", "CpImpl",
    "DataConfig", "DataSource", "Decay", "DeviceKind", "Dtype", "Engine", "EvalConfig",
    "Float8", "Float8Filter", "FsdpConfig", "LaunchConfig", "LoraConfig", "LossKind", "ModelConfig",
    "ModelInit", "NonFinite", "OnSaveError", "OptimConfig", "OptimImpl", "OutputConfig",
    "ParallelConfig", "PpSchedule", "PrecisionConfig", "ProfileConfig", "RecipeConfig",
    "ResolvedRecipe", "ScheduleConfig", "Sharding", "TUNE_KNOBS", "TUNE_NUMERICS_KNOBS",
    "TokenDtype", "TrainConfig", "Truncate", "TuneConfig", "WrapPolicy", "accelerator_device_nodes",
    "builtin_recipes", "config_to_dict", "dump_config", "explain", "launch_device_problem",
    "load_recipe", "parse_overrides", "parse_size", "recipe_reference", "schema_fields",
    "validate",
]  # fmt: skip
