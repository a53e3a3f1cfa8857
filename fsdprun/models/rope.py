"""Rotary factors chosen per document, for the rope types that transformers chooses from the
input's length: `longrope` (the short or the long factors) and `dynamic` (NTK scaling of the base).

transformers decides them once per forward from `max(position_ids) + 1` (its `dynamic_rope_update`
around the rotary embedding's forward). That is the document's length only when a row holds one
document and one rank holds the row. A packed row holds several documents, whose positions
restart at each: the longest would decide for all of them, so a short document beside a long one
would train with the long factors. Under context parallel a rank holds a slice of each row: cp
rank 0 would decide from its slice alone. Here each token takes the factors of the document it
belongs to, at its length in the whole row (`document_lengths`): each document trains as it
would alone, and every cp rank as one rank. Each length class is computed by transformers' own
functions (the rope type's init function and the rotary module's forward, undecorated), so none
of the rope arithmetic is fsdprun's; the other types (default, linear, llama3, yarn, ...) depend
on the positions alone and are left to transformers.

Stateless, as transformers is on a document alone in a fresh model: transformers' `dynamic` keeps
the largest length it has seen (an inference cache for generation) and applies it to the shorter
inputs that follow; here every document gets the factors of its own length.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch import nn

from fsdprun.config.layout import cp_chunks


def depends_on_length(rope_type: str) -> bool:
    """Whether transformers chooses the rope type's factors from the input's largest position
    (`dynamic_rope_update`'s own test)."""
    return rope_type == "longrope" or "dynamic" in rope_type


def document_lengths(
    doc_ids: torch.Tensor | None, *, local: int, index: int = 0, count: int = 1,
    zigzag: bool = False,
) -> torch.Tensor | int:  # fmt: skip
    """Each token's document length in the whole row: what transformers would take as the
    input's length were the document forwarded alone.

    Args:
        doc_ids: (batch, whole row) document ids of packed rows (-1: padding), whose positions
            count 0, 1, ... within each document (`fsdprun.data.Row`): a document's length is its
            number of tokens; None for rows of one document each.
        local: the tokens of each row this rank holds.
        index, count, zigzag: the rank holds part `index` of `count` of each row (context
            parallel: `fsdprun.config.layout.cp_chunks`, as `Batch.sequence_shard` cuts it);
            0 of 1 without it.

    Returns:
        The whole row's length when it is one document (no doc_ids), else the (batch, local)
        lengths of this rank's tokens (1 for padding, which attends to itself only).
    """
    if doc_ids is None:
        return local * count
    whole = doc_ids.shape[1]
    ids = doc_ids + 1  # padding at 0; a row holds at most `whole` documents
    counts = torch.zeros(ids.shape[0], whole + 1, dtype=ids.dtype, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids))
    lengths = counts.gather(1, ids).masked_fill(doc_ids < 0, 1)
    return torch.cat([lengths[:, part] for part in cp_chunks(whole, index, count, zigzag=zigzag)],
                     dim=1)  # fmt: skip


class DocumentRope:
    """The rotary embeddings of a transformers model whose rope type depends on the input's
    length, made to take each token's document length: for one forward, inside `documents`."""

    def __init__(self, model: nn.Module):
        self.lengths: torch.Tensor | int | None = None
        self.row_length = 0  # the whole row's: no document is longer
        self.modules: list[nn.Module] = []
        for module in model.modules():
            rope_forward = _inner_forward(module)
            if rope_forward is not None:
                module.forward = _RotaryByDocument(self, module, rope_forward)
                self.modules.append(module)

    @contextlib.contextmanager
    def documents(
        self, doc_ids: torch.Tensor | None, *, local: int, index: int, count: int,
        zigzag: bool = False,
    ):  # fmt: skip
        """Inside: the rotary embeddings choose each token's factors from its document's length
        (`document_lengths`' arguments)."""
        if not self.modules:
            yield
            return
        self.lengths = document_lengths(doc_ids, local=local, index=index, count=count,
                                        zigzag=zigzag)  # fmt: skip
        self.row_length = local * count
        try:
            yield
        finally:
            self.lengths = None


def _inner_forward(module: nn.Module):
    """The forward inside transformers' `dynamic_rope_update` of a rotary embedding whose rope
    type (or one of its layer types') depends on the length: it computes cos and sin from the
    module's `inv_freq` as it is. None for any other module: where transformers does not update
    the factors, they depend on the positions alone."""
    kinds = getattr(module, "rope_type", None)
    kinds = kinds.values() if isinstance(kinds, dict) else [kinds]
    if not any(isinstance(kind, str) and depends_on_length(kind) for kind in kinds):
        return None
    if not any(name.endswith("inv_freq") for name in module._buffers):
        return None
    decorated = type(module).forward
    inner = inspect.unwrap(decorated)
    return None if inner is decorated else inner


class _RotaryByDocument:
    """One rotary module's forward with per-document factors (`DocumentRope`)."""

    def __init__(self, rope: DocumentRope, module: nn.Module, rope_forward):
        self.rope, self.module, self.rope_forward = rope, module, rope_forward
        self.tables: dict[tuple, tuple[torch.Tensor, float]] = {}

    def __call__(self, x, position_ids, layer_type=None):
        module, rope = self.module, self.rope
        kind = module.rope_type if layer_type is None else module.rope_type[layer_type]
        extra = () if layer_type is None else (layer_type,)
        if rope.lengths is None or not depends_on_length(kind):
            return type(module).forward(module, x, position_ids, *extra)
        cos = sin = None
        for seq_len, where in self._classes(kind, rope, layer_type):
            c, s = self.rope_forward(self._at(seq_len, kind, layer_type, x.device), x,
                                     position_ids, *extra)  # fmt: skip
            if cos is None:
                cos, sin = c, s
            else:
                cos = torch.where(where[..., None], c, cos)
                sin = torch.where(where[..., None], s, sin)
        return cos, sin

    def _classes(self, kind: str, rope: DocumentRope, layer_type) -> list:
        """(a length standing for the class, which tokens take it) for each class of lengths
        that share their factors; the first class's tokens are those no other class takes."""
        module = self.module
        if kind == "longrope":  # the short factors up to the original length, else the long
            params = getattr(module.config, "rope_parameters", None) or {}
            params = (params.get(layer_type) if layer_type else params) or {}
            floor = (params.get("original_max_position_embeddings")
                     or getattr(module.config, "original_max_position_embeddings", None)
                     or module.config.max_position_embeddings)  # fmt: skip
            ceiling = floor + 1
        else:  # dynamic: the base scaled by the length past max_position_embeddings
            floor, ceiling = module.original_max_seq_len, None
        lengths = rope.lengths
        if rope.row_length <= floor:
            return [(floor, None)]  # no document is longer
        if isinstance(lengths, int):  # the row is one document, longer than floor
            return [(lengths if ceiling is None else ceiling, None)]
        clamped = lengths.clamp(floor, ceiling)
        if ceiling is not None:
            values = list(range(floor, ceiling + 1))
        else:
            values = clamped.unique().tolist()  # a CPU-GPU sync, as transformers' own update
        return [(v, clamped == v) for v in values]

    def _at(self, seq_len: int, kind: str, layer_type, device) -> _StandIn:
        """A stand-in of the module holding the rope type's frequencies and attention scaling
        for inputs of `seq_len` tokens (transformers' init function of the type, as its
        `dynamic_rope_update` calls it)."""
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        key = (layer_type, seq_len, device)
        if key not in self.tables:
            by_layer = {} if layer_type is None else {"layer_type": layer_type}
            self.tables[key] = ROPE_INIT_FUNCTIONS[kind](
                self.module.config, device, seq_len=seq_len, **by_layer
            )
        inv_freq, scaling = self.tables[key]
        prefix = "" if layer_type is None else f"{layer_type}_"
        return _StandIn(self.module, {f"{prefix}inv_freq": inv_freq,
                                      f"{prefix}attention_scaling": scaling})  # fmt: skip


class _StandIn:
    """The rotary module as its forward reads it, with some attributes replaced: a plain
    object, not a copy of the module (torch.compile traces it, and does not trace copying a
    module)."""

    def __init__(self, module: nn.Module, replaced: dict):
        self._module = module
        self.__dict__.update(replaced)

    def __getattr__(self, name: str):
        return getattr(self._module, name)
