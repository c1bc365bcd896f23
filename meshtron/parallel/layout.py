"""Does a parallel layout fit the world size, the model and the batch? Pure checks, no process group.

Every rule names the values and a fix (:class:`~meshtron.config.ConfigError`) and runs on every rank
before any collective, so a bad layout never hangs. Each parallelism contributes its own rules
(tensor parallelism the head split, the pipeline its schedule's). See docs/training.md, 'The mesh'.
"""

from __future__ import annotations

from meshtron.config import Config, ConfigError, expert_keys_without_experts, rank_batch, round_up
from meshtron.mesh import ExpertSplit, check_expert_split, check_sizes, expert_hsdp_shards
from meshtron.parallel.context import check_context_parallel, cp_ranks_per_node, unbalanced_seq_len
from meshtron.parallel.expert import check_expert_tp_divisible, ep_does_not_divide
from meshtron.parallel.pipeline.schedules import interleaving_refused
from meshtron.parallel.pipeline.split import too_few_layers
from meshtron.parallel.pipeline.stage import check_pipeline
from meshtron.parallel.tensor import check_tensor_parallel, local_heads

# Error messages list valid tp/ep choices up to one 8-GPU node, or the world size if larger.
_SUGGEST_UP_TO = 8


def _options(ok, limit: int, shown: int = 12) -> str:
    """The first ``shown`` values in 1..limit that satisfy ``ok`` (bounded: limit may be huge)."""
    found = []
    for v in range(1, limit + 1):
        if ok(v):
            found.append(str(v))
            if len(found) == shown:
                return ", ".join(found) + ", ..."
        if v > 4096 and found:
            break
    return ", ".join(found)


def validate_layout(cfg: Config, world_size: int) -> None:
    """Check that the parallel layout fits the world size, the model and the batch; no process group needed.

    Raises :class:`ConfigError` naming the values and a fix. ``sp`` with ``tp = 1`` is allowed and
    does nothing (there is no tp group to split the sequence over). Schedule-specific checks of
    microbatches against stages come from the pipeline module (``check_pipeline``).
    """
    m, p, t = cfg.model, cfg.parallel, cfg.train
    sizes = dict(pp=p.pp, dp=p.dp, cp=p.cp, ep=p.mesh_ep, tp=p.tp)
    check_sizes(sizes, world_size, "[parallel] ")
    split = ExpertSplit(p.ep, p.etp, p.fold_ep)
    check_expert_split(sizes, split, "[parallel] ")
    if p.data_parallel == "hsdp" and m.is_moe:
        expert_hsdp_shards(sizes, split)  # experts must shard inside a dp slice
    limit = max(_SUGGEST_UP_TO, world_size)
    check_tensor_parallel(m.num_attention_heads, m.kv_heads, p.tp)
    # config's rule (config_from_dict ran it already unless [model] hf_model: that model is known only here)
    expert_keys = expert_keys_without_experts(p)
    if expert_keys and not m.is_moe:
        raise ConfigError(f"[parallel] {expert_keys}")
    if m.is_moe and m.num_experts % p.ep:
        valid = _options(lambda v: m.num_experts % v == 0, limit)
        raise ConfigError(f"{ep_does_not_divide(m.num_experts, p.ep)}. Valid ep up to {limit}: {valid}.")
    if m.is_moe:
        check_expert_tp_divisible(m.moe_intermediate_size, p.etp)
    refused = interleaving_refused(p.pp, p.virtual_stages) if p.schedule == "interleaved" else None
    if refused:
        raise ConfigError(f"[parallel] schedule = 'interleaved' {refused}. Raise them or use schedule = '1f1b'.")
    refused = too_few_layers(m.num_hidden_layers, p.pp * p.virtual_stages)
    if refused:
        raise ConfigError(f"[model] {refused}")
    heads, kv_heads = local_heads(m.num_attention_heads, m.kv_heads, p.tp)
    check_context_parallel(
        p.cp_comm_type, p.cp, heads, kv_heads, None, p.cp_a2a_size, None, cp_ranks_per_node(p.tp, p.mesh_ep)
    )
    if p.cp > 1 and t.seq_len % (2 * p.cp):
        raise ConfigError(
            f"{unbalanced_seq_len(t.seq_len, p.cp)} Use seq_len = {round_up(t.seq_len, 2 * p.cp)} or change cp."
        )
    if p.sp and p.tp > 1 and t.seq_len % (p.cp * p.tp):
        # Each cp rank holds seq_len / cp tokens, which sequence parallelism splits over tp.
        raise ConfigError(
            f"[train] seq_len = {t.seq_len} must be a multiple of cp x tp = {p.cp * p.tp} with sp = true. "
            f"Use seq_len = {round_up(t.seq_len, p.cp * p.tp)} or set sp = false."
        )
    local = rank_batch(cfg)
    if local % p.microbatches:
        raise ConfigError(
            f"[parallel] microbatches = {p.microbatches} does not divide the per-rank batch "
            f"global_batch_size / (dp x ep) = {t.global_batch_size} / {p.dp * p.mesh_ep} = {local}. "
            f"Valid microbatches: {_options(lambda v: local % v == 0, local)}."
        )
    if p.pp > 1:
        check_pipeline(cfg)  # the schedule's own rules
