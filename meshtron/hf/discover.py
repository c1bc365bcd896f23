"""Where a transformers causal LM keeps its parts, read from the model's own structure.

Families name the same parts differently (``model.layers`` / ``transformer.h`` / ``gpt_neox.layers``; ``norm`` /
``ln_f``), so :func:`hf_parts` finds the decoder, blocks, embeddings, head, final norm and rotary embedding
through the model's API and its forward's source instead of assuming one family's names.
See docs/hf.md, 'Finding the parts'.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from dataclasses import dataclass

from torch import nn

from meshtron.config import ConfigError


@dataclass(frozen=True)
class HFParts:
    decoder: nn.Module
    decoder_path: str
    blocks: nn.ModuleList | nn.ModuleDict  # a pipeline stage: ModuleDict keyed by the global block index
    blocks_path: str
    embed: nn.Module | None  # None: another pipeline stage holds it (also head and norm)
    embed_path: str
    head: nn.Module | None
    head_path: str
    norm: nn.Module | None
    norm_path: str
    embed_norm: nn.Module | None  # the norm the decoder runs on the embeddings before the blocks, if any
    embed_norm_path: str | None
    rotary: nn.Module | None
    rotary_path: str | None

    @property
    def plan_blocks(self) -> str:
        """The blocks' path relative to the decoder: the first part of tp-plan patterns (``layers``)."""
        return _relative(self.blocks_path, self.decoder_path)

    @property
    def plan_embed(self) -> str:
        """The input embedding's path relative to the decoder, as a tp-plan entry names it (``embed_tokens``)."""
        return _relative(self.embed_path, self.decoder_path)

    @property
    def tied(self) -> bool:
        """Embedding and head share one weight here (a pipeline holds them on different stages)."""
        return self.embed is not None and self.head is not None and self.head.weight is self.embed.weight

    def block_items(self) -> list[tuple[int, nn.Module]]:
        """(global block index, block) of every block held here, in model order."""
        if isinstance(self.blocks, nn.ModuleDict):
            return [(int(i), block) for i, block in self.blocks.items()]
        return list(enumerate(self.blocks))


def is_norm(module: nn.Module) -> bool:
    """LayerNorm, RMSNorm and the families' own norm classes (``Gemma2RMSNorm``, ``CohereLayerNorm``, ...)."""
    return isinstance(module, nn.LayerNorm) or "Norm" in type(module).__name__


def _relative(path: str, prefix: str) -> str:
    return path[len(prefix) + 1 :] if prefix else path


def _missing(model: nn.Module, what: str, why: str) -> ConfigError:
    return ConfigError(
        f"parallelize_hf_model: cannot find the {what} of {type(model).__name__}: {why}. "
        "meshtron supports decoder-only transformers *ForCausalLM models."
    )


def _path_of(model: nn.Module, module: nn.Module | None, what: str) -> str:
    for name, candidate in model.named_modules():
        if candidate is module:
            return name
    raise _missing(model, what, f"{what} is not a submodule of the model" if module is not None else f"no {what}")


def _decoder(model: nn.Module) -> nn.Module:
    """``get_decoder()``; where that contract fails (Llama 4 text keeps its base model in ``self.model``
    but declares ``base_model_prefix = "language_model"``), the one direct child holding the input
    embeddings and the blocks."""
    get = getattr(model, "get_decoder", None)
    decoder = get() if get is not None else None
    if decoder is not None and decoder is not model:
        return decoder
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    holders = [
        child
        for _, child in model.named_children()
        if embed is not None
        and any(m is embed for m in child.modules())
        and any(isinstance(m, nn.ModuleList) for m in child.modules())
    ]
    if len(holders) != 1:
        raise _missing(
            model,
            "decoder",
            "get_decoder() returns no separate base model, and "
            f"{len(holders)} direct children hold the input embeddings and a list of blocks (need one)",
        )
    return holders[0]


def _is_block(module: nn.Module, block_classes: set[str]) -> bool:
    # by the class or a base: FSDP's wrapping subclasses it (FSDPLlamaDecoderLayer)
    return any(cls.__name__ in block_classes for cls in type(module).__mro__)


def _blocks(model: nn.Module, decoder: nn.Module) -> tuple[str, nn.ModuleList]:
    block_classes = set(getattr(model, "_no_split_modules", None) or ())
    if not block_classes:
        return _blocks_by_structure(model, decoder)
    found = [
        (name, m)
        for name, m in decoder.named_modules()
        if isinstance(m, nn.ModuleList) and len(m) and all(_is_block(b, block_classes) for b in m)
    ]
    if len(found) != 1:
        raise _missing(
            model,
            "decoder blocks",
            f"{len(found)} nn.ModuleLists of {sorted(block_classes)} "
            "_no_split_modules classes in its decoder (need exactly one)",
        )
    return found[0]


def _blocks_by_structure(model: nn.Module, decoder: nn.Module) -> tuple[str, nn.ModuleList]:
    """Where the model declares no ``_no_split_modules`` (BioGPT): the one ``nn.ModuleList`` in the decoder
    of ``config.num_hidden_layers`` modules of one class, each with parameters."""
    layers = getattr(model.config, "num_hidden_layers", None)
    found = [
        (name, m)
        for name, m in decoder.named_modules()
        if isinstance(m, nn.ModuleList)
        and len(m) == layers
        and len({type(b) for b in m}) == 1
        and all(any(True for _ in b.parameters()) for b in m)
    ]
    if len(found) != 1:
        raise _missing(
            model,
            "decoder blocks",
            f"it declares no _no_split_modules, and {len(found)} nn.ModuleLists in its decoder hold "
            f"config.num_hidden_layers = {layers} modules of one class (need exactly one)",
        )
    return found[0]


def _forward_source(module: nn.Module) -> str | None:
    try:
        return inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return None


def calls_attention_interface(module: nn.Module) -> bool:
    """Whether ``module``'s forward computes attention through transformers' attention interface (an
    attention module whatever its name: ``self_attn``, CodeGen's ``attn``, GPT-NeoX's ``attention``; mamba,
    convolution and lightning-attention mixers do not)."""
    return "ALL_ATTENTION_FUNCTIONS" in (_forward_source(module) or "")


def _first_uses(source: str | None) -> dict[str, int] | None:
    """Where a ``forward``'s ``source`` first reads each ``self.<name>`` (character offset): the order
    the forward runs its children in. None when the source cannot be read."""
    if source is None:
        return None
    first: dict[str, int] = {}
    for match in re.finditer(r"self\.(\w+)", source):
        first.setdefault(match.group(1), match.start())
    return first


def _calls(source: str, name: str) -> list[int]:
    """Where ``source`` calls ``self.<name>(...)`` (character offsets)."""
    return [m.start() for m in re.finditer(rf"self\.{name}\(", source)]


def _final_norm(model: nn.Module, decoder: nn.Module, blocks_rel: str) -> tuple[str, nn.Module]:
    """The decoder's direct child norm its forward calls after the blocks (Bloom also normalises its
    embeddings before them with another norm, NanoChat with the same one; Lfm2 names its final norm
    ``embedding_norm``); where no norm runs there, the one module with parameters that does (Qwen4-Exp's
    ``hyper_connection_mixer`` folds its hyper-connection streams into the head's input)."""
    norms = [(name, m) for name, m in decoder.named_children() if is_norm(m)]
    source = _forward_source(decoder)
    uses = _first_uses(source)
    top = blocks_rel.split(".", 1)[0]
    if uses is not None and top in uses:

        def runs_after(name: str) -> bool:
            return max(_calls(source, name), default=uses.get(name, -1)) > uses[top]

        after = [(n, m) for n, m in norms if runs_after(n)] or [
            (n, m) for n, m in decoder.named_children() if runs_after(n) and any(True for _ in m.parameters())
        ]
        why = f"of its {len(norms)} direct child norms, {len(after)} run after '{top}' in its forward"
    else:  # no source to read: by name, the embedding norms excluded
        after = [(n, m) for n, m in norms if "emb" not in n]
        why = f"{len(after)} norm modules not named like an embedding norm directly in its decoder"
    if len(after) != 1:
        raise _missing(model, "final norm", f"{why} ({', '.join(n for n, _ in after) or 'none'}); need exactly one")
    return after[0]


def _embedding_norm(decoder: nn.Module, blocks_rel: str) -> tuple[str, nn.Module] | None:
    """The decoder's direct child norm its forward calls on the embeddings before the blocks (Bloom's
    ``word_embeddings_layernorm``; NanoChat's one ``norm``, also its final norm), or None."""
    source = _forward_source(decoder)
    uses = _first_uses(source)
    top = blocks_rel.split(".", 1)[0]
    if uses is None or top not in uses:
        return None
    before = [
        (name, m)
        for name, m in decoder.named_children()
        if is_norm(m) and min(_calls(source, name), default=len(source)) < uses[top]
    ]
    return before[0] if len(before) == 1 else None


def block_call(parts: HFParts) -> tuple[int, list[str]] | None:
    """How the decoder's forward calls each block: (how many positional arguments, the keywords it names),
    read from the loop over the blocks in its source (Gemma 4 hands its blocks a ``per_layer_input`` as a
    second positional and ``shared_kv_states``); None when the source or the loop cannot be read."""
    source = _forward_source(parts.decoder)
    if source is None:
        return None
    top = parts.plan_blocks.split(".", 1)[0]
    for loop in ast.walk(ast.parse(textwrap.dedent(source))):
        if not (isinstance(loop, ast.For) and _reads_attribute(loop.iter, top)):
            continue
        names = {n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)}
        for call in ast.walk(loop):
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in names:
                return len(call.args), [k.arg for k in call.keywords if k.arg is not None]
    return None


def _reads_attribute(node: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == name for n in ast.walk(node))


def is_rotary(module: nn.Module) -> bool:
    """A rotary embedding: RoPE frequencies (``inv_freq``), or one set per layer type (``<type>_inv_freq``)."""
    return hasattr(module, "inv_freq") or any(
        name.endswith("_inv_freq") for name, _ in module.named_buffers(recurse=False)
    )


def _rotary(decoder: nn.Module, blocks: nn.ModuleList) -> tuple[str, nn.Module] | None:
    in_blocks = {id(m) for m in blocks.modules()}
    owners = [(name, m) for name, m in decoder.named_modules() if is_rotary(m) and id(m) not in in_blocks]
    return owners[0] if owners else None


# ``inputs_embeds = inputs_embeds * self.embedding_multiplier``: the embeddings rescaled in the decoder's forward.
_RESCALED = re.compile(r"^[ \t]*(?:inputs_embeds|hidden_states)\s*=\s*(?:inputs_embeds|hidden_states)\s*[*/].*$", re.M)


def embedding_rescaling(parts: HFParts) -> str | None:
    """The statement by which the decoder's forward rescales the embeddings before its blocks (Granite's
    ``embedding_multiplier``), or None: none, or the family scales inside its embedding module (Gemma's
    ``*ScaledWordEmbedding``), which a pipeline's first stage runs as it is."""
    source = _forward_source(parts.decoder)
    uses = _first_uses(source)
    top = parts.plan_blocks.split(".", 1)[0]
    if source is None or top not in uses:
        return None
    found = [m.group(0).strip() for m in _RESCALED.finditer(source) if m.start() < uses[top]]
    return found[0] if found else None


_STAGE_PARTS = "_meshtron_stage_parts"


def set_stage_parts(model: nn.Module, parts: HFParts) -> None:
    """Record the parts of a model pruned to a pipeline stage, which discovery could no longer find
    (no embedding or head there, blocks in a ModuleDict)."""
    setattr(model, _STAGE_PARTS, parts)


def key_value_heads(config) -> int:
    """Key/value heads of a transformers config (configs without GQA have none: one per query head)."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def layer_config(config, index: int):
    """Decoder layer ``index``'s config: transformers' per-layer view where the config holds per-layer values
    (``per_layer_config``: Gemma 4's full-attention layers have a head_dim of their own, and reading it from
    the global config raises), else the config itself."""
    return config.per_layer_config[index] if getattr(config, "is_heterogeneous", False) else config


def layer_heads(config, index: int) -> tuple[int, int]:
    """(query heads, key/value heads) of decoder layer ``index``."""
    own = layer_config(config, index)
    return own.num_attention_heads, key_value_heads(own)


def hf_parts(model: nn.Module) -> HFParts:
    """The decoder, blocks, embeddings, output head, final norm and rotary embedding of ``model``
    (meta or materialised); a :class:`ConfigError` names the part that cannot be found."""
    stage = model.__dict__.get(_STAGE_PARTS)
    if stage is not None:
        return stage
    decoder = _decoder(model)
    decoder_path = _path_of(model, decoder, "decoder")
    blocks_rel, blocks = _blocks(model, decoder)
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        raise _missing(model, "output head", f"get_output_embeddings() returns {type(head).__name__}, not an nn.Linear")
    norm_rel, norm = _final_norm(model, decoder, blocks_rel)
    embed_norm = _embedding_norm(decoder, blocks_rel)
    rotary = _rotary(decoder, blocks)

    def full(rel: str) -> str:
        return f"{decoder_path}.{rel}" if decoder_path else rel

    return HFParts(
        decoder=decoder,
        decoder_path=decoder_path,
        blocks=blocks,
        blocks_path=full(blocks_rel),
        embed=embed,
        embed_path=_path_of(model, embed, "input embeddings"),
        head=head,
        head_path=_path_of(model, head, "output head"),
        norm=norm,
        norm_path=full(norm_rel),
        embed_norm=embed_norm[1] if embed_norm else None,
        embed_norm_path=full(embed_norm[0]) if embed_norm else None,
        rotary=rotary[1] if rotary else None,
        rotary_path=full(rotary[0]) if rotary else None,
    )


__all__ = [
    "HFParts",
    "block_call",
    "calls_attention_interface",
    "embedding_rescaling",
    "hf_parts",
    "is_norm",
    "is_rotary",
    "key_value_heads",
    "layer_config",
    "layer_heads",
    "set_stage_parts",
]
