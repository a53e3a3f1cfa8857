"""The device mesh of a run, built in one function from its `Layout` (`fsdprun.config.layout`,
which decides every degree, size and dim name), and the sub-meshes each parallelism works over:
FSDP's data-parallel dims, tensor parallel's `tp`, context parallel's `cp`, expert parallel's
`ep` and the dims FSDP shards each expert over.

Imports torch where a function runs (the engines' knob tables load this package without it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsdprun.config.layout import Layout

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def build_device_mesh(layout: Layout, device_kind: str) -> DeviceMesh:
    """The run's device mesh with the layout's named dims (`Layout.mesh_dims`), outermost
    first: tp innermost, so a TP group is consecutive ranks (one node), then cp. A mesh of one
    dim is 1-D and unnamed (full and grad_op sharding without TP or CP); the hybrid modes'
    `replicate x shard` is 2-D even where one of the two is 1 (FSDP1's hybrid strategies
    require a 2-D mesh)."""
    from torch.distributed.device_mesh import init_device_mesh

    dims = layout.mesh_dims
    if len(dims) == 1:
        return init_device_mesh(device_kind, (layout.world_size,))
    names = tuple(name for name, _ in dims)
    return init_device_mesh(device_kind, tuple(n for _, n in dims), mesh_dim_names=names)


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The dims `fully_shard` shards over: dp_shard alone (full, grad_op) or dp_replicate x
    dp_shard (hybrid, hybrid_zero2, none); with a `cp` dim, dp_shard x cp flattened into one
    (`dp_shard_cp`), so that the cp ranks share one copy of the model state (torchtitan's);
    with an `ep` dim, dp_shard_mod_ep x ep flattened back into the `dp_shard` they split."""
    names = mesh.mesh_dim_names or ()
    shard = "dp_shard"
    if "ep" in names:
        mesh[("dp_shard_mod_ep", "ep")]._flatten(shard)
    if "cp" in names:
        shard = "dp_shard_cp"
        mesh[("dp_shard", "cp")]._flatten(shard)
    dims = [*(["dp_replicate"] if "dp_replicate" in names else []), shard]
    return mesh[dims[0]] if len(dims) == 1 else mesh[tuple(dims)]


def tp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The `tp` dim of the mesh: one TP group per data-parallel rank."""
    return mesh["tp"]


def cp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The `cp` dim of the mesh: one cp group per data-parallel (and tp) rank."""
    return mesh["cp"]


def ep_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The `ep` dim of the mesh: the ranks one layer's experts are sharded over."""
    return mesh["ep"]


def expert_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The dims `fully_shard` shards each expert's weights over under expert parallel: the
    data-parallel ranks outside the ep group (`dp_shard_mod_ep`), so that FSDP and ep together
    shard the experts over every data-parallel rank."""
    names = mesh.mesh_dim_names or ()
    if "dp_replicate" in names:  # hybrid sharding: replicated across the shard groups
        return mesh[("dp_replicate", "dp_shard_mod_ep")]
    return mesh["dp_shard_mod_ep"]
