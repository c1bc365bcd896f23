"""Recipe loading, validation and command-line overrides (no process group needed)."""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path

import pytest
import tomllib
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshtron.config import (
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    config_from_dict,
    infer_dp,
    load_config,
    parse_overrides,
)
from meshtron.parallel.layout import validate_layout

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
ALL_RECIPES = sorted(RECIPES.glob("*.toml"))
DEBUG = {name: tomllib.loads((RECIPES / f"{name}.toml").read_text()) for name in ("debug_dense", "debug_moe")}


def write(tmp_path: Path, text: str, name: str = "recipe.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def edited(name: str, section: str, key: str, value) -> dict:
    raw = copy.deepcopy(DEBUG[name])
    raw[section][key] = value
    return raw


def test_recipes_exist():
    names = {p.stem for p in ALL_RECIPES}
    assert {"debug_dense", "debug_moe", "qwen2p5_7b", "qwen2_57b_a14b", "qwen1p5_moe_a2p7b"} <= names


@pytest.mark.parametrize("path", ALL_RECIPES, ids=lambda p: p.stem)
def test_every_recipe_loads_and_sets_every_key(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    raw = tomllib.loads(path.read_text())
    assert set(raw) == {"model", "parallel", "train", "data", "checkpoint"}
    # Recipes spell out every knob of the layout and training so nothing depends on defaults.
    for section in ("parallel", "train", "data", "checkpoint"):
        fields = {f for f in getattr(cfg, section).__dataclass_fields__}
        assert set(raw[section]) == fields, section
    assert raw["model"]["hidden_size"] == cfg.model.hidden_size


@pytest.mark.parametrize("path", ALL_RECIPES, ids=lambda p: p.stem)
def test_every_recipe_layout_is_valid_on_its_declared_hardware(path):
    """world = nodes x devices per node from the header's '# Hardware:' line (tests/test_plan.py checks
    that the layout also fits that hardware's memory)."""
    from meshtron.plan.recipes import recipe_hardware

    world = recipe_hardware(path).world_size
    validate_layout(infer_dp(load_config(path), world), world_size=world)


@pytest.mark.parametrize(
    "name, overrides, pattern",
    [
        (
            "qwen1p5_moe_a2p7b",
            ["--parallel.dp=1", "--parallel.ep=8"],
            r"ep = 8 does not divide \[model\] num_experts = 60",
        ),
        (
            "qwen2p5_7b",
            ["--parallel.dp=1", "--parallel.tp=8"],
            r"tp = 8 does not divide .*Valid tp up to 8 for this model: 1, 2, 4\.",
        ),
        ("debug_dense", ["--parallel.dp=4"], r"world size"),
    ],
)
def test_invalid_layouts_of_real_recipes(name, overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        validate_layout(load_config(RECIPES / f"{name}.toml", overrides), world_size=8)


@pytest.mark.parametrize("path", ALL_RECIPES, ids=lambda p: p.stem)
def test_every_recipe_names_its_source(path):
    header = path.read_text().split("[model]")[0]
    assert header.startswith("# ")
    if not path.stem.startswith("debug_"):
        assert "huggingface.co/Qwen/" in header and "config.json" in header


def test_debug_recipes_match_the_brief():
    dense, moe = load_config(RECIPES / "debug_dense.toml"), load_config(RECIPES / "debug_moe.toml")
    for cfg in (dense, moe):
        m = cfg.model
        assert (m.hidden_size, m.num_hidden_layers, m.num_attention_heads, m.kv_heads) == (64, 4, 8, 2)
        assert (m.head_size, m.vocab_size, cfg.train.seq_len, cfg.train.dtype) == (8, 256, 64, "float32")
    assert not dense.model.is_moe and dense.parallel.dp == 0 and infer_dp(dense, 8).parallel.dp == 8
    assert (moe.model.num_experts, moe.model.num_experts_per_tok, moe.model.norm_topk_prob) == (8, 2, False)
    assert (moe.parallel.dp, moe.parallel.ep, infer_dp(moe, 8).parallel.dp) == (0, 4, 2)


@pytest.mark.parametrize(
    "overrides, world, inferred",
    [
        ([], 8, 1),  # no pipeline: one micro-batch
        (["--parallel.pp=4", "--parallel.dp=2"], 8, 4),  # 1F1B: one per stage
        (["--parallel.pp=2", "--parallel.dp=2", "--train.global_batch_size=12"], 4, 2),
        # interleaved: a multiple of pp (3 divides the 6 rows but is not one)
        (
            [
                "--parallel.pp=2",
                "--parallel.dp=2",
                "--train.global_batch_size=12",
                "--parallel.schedule=interleaved",
                "--parallel.virtual_stages=2",
            ],
            4,
            2,
        ),
        (
            ["--parallel.pp=4", "--parallel.dp=1", "--train.global_batch_size=6", "--parallel.tp=2"],
            8,
            6,
        ),  # 4, 5 don't divide
        (
            ["--parallel.pp=2", "--parallel.dp=2", "--parallel.schedule=zbv", "--parallel.virtual_stages=2"],
            4,
            4,
        ),  # 2 x pp
    ],
)
def test_microbatches_zero_takes_the_fewest_that_divide_the_batch_and_run(overrides, world, inferred):
    raw = load_config(RECIPES / "debug_dense.toml", ["--parallel.microbatches=0", *overrides])
    assert raw.parallel.microbatches == (0 if raw.parallel.dp == 0 else inferred)  # known once dp is
    cfg = infer_dp(raw, world)
    assert cfg.parallel.microbatches == inferred and cfg.train.global_batch_size == raw.train.global_batch_size
    validate_layout(cfg, world)


def test_microbatches_zero_without_a_count_that_runs_names_the_batch():
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "[parallel] microbatches = 0 takes the fewest micro-batches that divide the per-rank batch "
            "global_batch_size / (dp x ep) = 3 and that schedule = '1f1b' runs on pp = 4 stages (at least 4); "
            "none does."
        ),
    ):
        load_config(
            RECIPES / "debug_dense.toml",
            ["--parallel.microbatches=0", "--parallel.pp=4", "--train.global_batch_size=6", "--parallel.dp=2"],
        )
    with pytest.raises(ConfigError, match=r"global_batch_size = 6 must be a multiple of dp x ep = 4"):
        infer_dp(
            load_config(RECIPES / "debug_dense.toml", ["--parallel.microbatches=0", "--train.global_batch_size=6"]), 4
        )
    with pytest.raises(ConfigError, match=r"\[parallel\] microbatches must not be negative, got -1"):
        load_config(RECIPES / "debug_dense.toml", ["--parallel.microbatches=-1"])


def test_tied_embeddings_follow_published_configs():
    tied = {p.stem for p in ALL_RECIPES if load_config(p).model.tie_word_embeddings}
    assert tied == {"qwen2p5_0p5b", "qwen2p5_1p5b", "qwen2p5_3b"}


def test_unknown_key_names_file_and_closest_key(tmp_path):
    path = write(tmp_path, "[model]\nhidden_sise = 64\n", "my_recipe.toml")
    with pytest.raises(
        ConfigError, match=r"my_recipe\.toml: unknown key 'hidden_sise' in \[model\]\. Did you mean 'hidden_size'"
    ):
        load_config(path)
    with pytest.raises(ConfigError, match=r"'microbatch' in \[parallel\]\. Did you mean 'microbatches'"):
        load_config(write(tmp_path, "[parallel]\nmicrobatch = 4\n"))
    with pytest.raises(ConfigError, match=r"unknown key 'banana' in \[train\]\. Valid keys: steps, seed"):
        load_config(write(tmp_path, "[train]\nbanana = 4\n"))


def test_unknown_section(tmp_path):
    with pytest.raises(ConfigError, match=r"recipe\.toml: unknown section \[trian\]\. Did you mean 'train'"):
        load_config(write(tmp_path, "[trian]\nsteps = 3\n"))
    with pytest.raises(ConfigError, match=r"unknown section \[optimizer\].*Valid sections: model, parallel"):
        load_config(write(tmp_path, "[optimizer]\nlr = 3\n"))


@pytest.mark.parametrize(
    "line, pattern",
    [
        ('[train]\nsteps = "10"', r"\[train\] steps must be an integer, got '10'"),
        ("[train]\nsteps = 10.0", r"\[train\] steps must be an integer, got 10\.0"),
        ("[parallel]\nsp = 1", r"\[parallel\] sp must be true or false, got 1"),
        ("[model]\ntie_word_embeddings = 0", r"tie_word_embeddings must be true or false"),
        ("[train]\nlr = true", r"\[train\] lr must be of type float, got True"),
        ("[train]\ndtype = 16", r"\[train\] dtype must be of type str, got 16"),
        ("[model]\nmlp_only_layers = 3", r"mlp_only_layers must be a list of int, got 3"),
        ('[model]\nmlp_only_layers = [1, "2"]', r"mlp_only_layers\[1\] must be an integer"),
        ("parallel = 3", r"\[parallel\] must be a table"),
    ],
)
def test_wrong_types(tmp_path, line, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(write(tmp_path, line + "\n"))


def test_int_is_accepted_for_float(tmp_path):
    cfg = load_config(write(tmp_path, "[train]\nlr = 1\n[model]\nrope_theta = 10000\n"))
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert isinstance(cfg.model.rope_theta, float)


def test_malformed_toml_names_the_line(tmp_path):
    path = write(tmp_path, "[model]\nhidden_size = 64\nnum_hidden_layers = = 4\n", "broken.toml")
    with pytest.raises(ConfigError, match=r"broken\.toml: malformed TOML: .*line 3"):
        load_config(path)


def test_missing_and_binary_files(tmp_path):
    with pytest.raises(ConfigError, match="is not a file"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="is not a file"):
        load_config(tmp_path)
    path = tmp_path / "binary.toml"
    path.write_bytes(b"\xff\xfe\x00[model]")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(path)


IMPOSSIBLE = [
    ("debug_dense", "model", "hidden_size", -64, r"hidden_size must not be negative, got -64"),
    ("debug_dense", "model", "num_hidden_layers", 0, r"num_hidden_layers must be positive"),
    ("debug_dense", "model", "num_key_value_heads", 3, r"multiple of num_key_value_heads \(3\)"),
    ("debug_dense", "model", "num_attention_heads", 6, r"not divisible by num_attention_heads"),
    ("debug_dense", "model", "head_dim", -8, r"head_dim must not be negative"),
    ("debug_dense", "model", "head_dim", 7, r"head size 7 must be even"),
    ("debug_dense", "model", "hidden_act", "gelu", r"hidden_act must be 'silu'"),
    ("debug_dense", "model", "rms_norm_eps", 0.0, r"rms_norm_eps must be > 0"),
    ("debug_dense", "model", "rope_theta", float("inf"), r"rope_theta must be a finite number"),
    ("debug_dense", "model", "mlp_only_layers", [1, 4], r"mlp_only_layers \[4\] are not layer indices 0\.\.3"),
    ("debug_moe", "model", "num_experts_per_tok", 9, r"num_experts_per_tok must be in 1\.\.num_experts \(8\)"),
    ("debug_moe", "model", "num_experts_per_tok", 0, r"num_experts_per_tok must be in 1\.\.num_experts"),
    ("debug_moe", "model", "moe_intermediate_size", 0, r"moe_intermediate_size must be > 0"),
    ("debug_moe", "model", "decoder_sparse_step", 0, r"decoder_sparse_step must be >= 1"),
    ("debug_moe", "model", "num_experts", -8, r"num_experts must not be negative"),
    ("debug_dense", "parallel", "tp", 0, r"tp must be >= 1, got 0"),
    (
        "debug_dense",
        "parallel",
        "schedule",
        "1F1B",
        r"schedule must be one of gpipe, 1f1b, interleaved.*Did you mean '1f1b'",
    ),
    ("debug_dense", "parallel", "schedule", "interleave", r"Did you mean 'interleaved'"),
    ("debug_dense", "parallel", "virtual_stages", 2, r"virtual_stages = 2 needs schedule = 'interleaved'"),
    ("debug_dense", "parallel", "schedule", "zbv", r"schedule = 'zbv' needs virtual_stages = 2 .*got 1"),
    ("debug_dense", "parallel", "schedule", "dualpipe", r"Did you mean 'dualpipev'"),
    ("debug_dense", "parallel", "ep", 2, r"ep = 2 needs an MoE model"),
    (
        "debug_dense",
        "parallel",
        "tp_overlap",
        True,
        r"\[parallel\] tp_overlap = true .* needs sp = true and tp > 1 \(got sp = false, tp = 1\)",
    ),
    (
        "debug_dense",
        "train",
        "dtype",
        "bf16",
        r"dtype must be one of float32, bfloat16, got 'bf16'.*Did you mean 'bfloat16'",
    ),
    ("debug_dense", "train", "dtype", "float16", r"dtype must be one of float32, bfloat16"),
    ("debug_dense", "train", "steps", 0, r"steps must be >= 1"),
    ("debug_dense", "train", "lr", 0.0, r"lr must be > 0"),
    ("debug_dense", "train", "lr", float("nan"), r"lr must be a finite number"),
    ("debug_dense", "train", "min_lr", 1.0, r"min_lr \(1\.0\) must not exceed lr"),
    ("debug_dense", "train", "beta2", 1.0, r"beta2 must be in \[0, 1\)"),
    ("debug_dense", "train", "warmup_steps", -1, r"warmup_steps must not be negative"),
    (
        "debug_dense",
        "train",
        "hang_timeout_s",
        600.0,
        r"\[train\] hang_timeout_s must be >= 0 \(0: automatic\) and shorter than collective_timeout_s \(600\.0\)",
    ),
    ("debug_dense", "checkpoint", "every", -5, r"\[checkpoint\] every must not be negative"),
    ("debug_dense", "data", "source", "", r"\[data\] source is empty"),
    ("debug_dense", "model", "vocab_size", 100, r"tokenizer 'bytes' needs \[model\] vocab_size >= 256"),
    ("debug_dense", "model", "hidden_size", 2**70, r"must fit in a signed 64-bit integer"),
]


@pytest.mark.parametrize("name, section, key, value, pattern", IMPOSSIBLE, ids=lambda v: str(v)[:20])
def test_impossible_values(name, section, key, value, pattern):
    with pytest.raises(ConfigError, match=pattern):
        config_from_dict(edited(name, section, key, value), source=f"{name}.toml")


def test_valid_layout_edits_load():
    """The checks must not reject layouts that are meant to work."""
    for section, values in [
        ("parallel", {"dp": 2, "tp": 4, "sp": True}),  # tp 4 > 2 KV heads: replicated
        ("parallel", {"dp": 1, "tp": 8, "sp": True}),
        ("parallel", {"dp": 4, "pp": 2, "schedule": "interleaved", "virtual_stages": 2, "microbatches": 4}),
        ("parallel", {"cp": 2, "dp": 4}),
    ]:
        raw = copy.deepcopy(DEBUG["debug_dense"])
        raw[section].update(values)
        validate_layout(config_from_dict(raw), world_size=8)
    raw = copy.deepcopy(DEBUG["debug_moe"])
    raw["model"].update(decoder_sparse_step=2, mlp_only_layers=[0, 2])
    raw["parallel"].update(dp=1, ep=8)
    cfg = config_from_dict(raw)
    validate_layout(cfg, world_size=8)
    m = cfg.model
    assert [m.is_moe_layer(i) for i in range(4)] == [False, True, False, True]


def test_overrides_apply_on_top_of_the_recipe():
    cfg = load_config(
        RECIPES / "debug_dense.toml",
        [
            "--parallel.tp",
            "2",
            "--parallel.dp=4",
            "--train.steps=10",
            "--model.mlp_only_layers",
            "[1,3]",
            "--train.dtype",
            "bfloat16",
            "--parallel.sp",
            "true",
            "--train.lr",
            "1e-3",
            "--data.source=./corpus",
        ],
    )
    assert (cfg.parallel.tp, cfg.parallel.dp, cfg.parallel.sp) == (2, 4, True)
    assert cfg.train.steps == 10 and cfg.train.dtype == "bfloat16" and cfg.train.lr == 1e-3
    assert cfg.model.mlp_only_layers == [1, 3]
    assert cfg.data.source == "./corpus"
    assert cfg.model.hidden_size == 64  # untouched keys keep the recipe's values


@pytest.mark.parametrize(
    "layout,name",
    [
        (ParallelConfig(), "single"),
        (
            ParallelConfig(pp=2, dp=2, tp=2, sp=True, schedule="zbv", virtual_stages=2, microbatches=4),
            "pp2_dp2_tp2_sp_zbv_v2_mb4",
        ),
        (
            ParallelConfig(
                dp=2,
                tp=4,
                ep=4,
                etp=2,
                fold_ep=True,
                data_parallel="hsdp",
                activation_checkpointing="op",
                ac_policy="parts",
                ac_parts=["mlp"],
            ),
            "dp2_ep4_tp4_etp2_fold_ep_hsdp_op_parts_ac_parts_mlp",
        ),
        (ParallelConfig(pp=4, dp=2), "pp4_dp2_1f1b"),
    ],
)
def test_a_layout_value_gives_a_recipe_that_layout(layout, name):
    """A layout written once as a ParallelConfig: its overrides on a recipe whose dp is inferred load as exactly
    that layout, its sizes multiply to its world size and its name shows what differs from the defaults."""
    cfg = load_config(RECIPES / "debug_moe.toml", layout.overrides())
    assert cfg.parallel == layout
    assert list(layout.sizes) == ["pp", "dp", "cp", "ep", "tp"]
    assert math.prod(layout.sizes.values()) == layout.world_size
    assert layout.name == name


def test_parse_overrides():
    assert parse_overrides(["--parallel.tp", "2", "--train.steps=10", "--train.lr", "-1.5"]) == {
        "parallel": {"tp": 2},
        "train": {"steps": 10, "lr": -1.5},
    }
    assert parse_overrides(["--model.mlp_only_layers", "[1, 3]"]) == {"model": {"mlp_only_layers": [1, 3]}}
    assert parse_overrides(["--train.output_dir=runs/a=b"]) == {"train": {"output_dir": "runs/a=b"}}


def test_override_with_unknown_key_errors_like_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"debug_dense\.toml: unknown key 'tpp' in \[parallel\]\. Did you mean 'tp'"):
        load_config(RECIPES / "debug_dense.toml", ["--parallel.tpp", "2"])
    with pytest.raises(ConfigError, match=r"unknown section \[paralel\]\. Did you mean 'parallel'"):
        load_config(RECIPES / "debug_dense.toml", ["--paralel.tp=2"])
    with pytest.raises(ConfigError, match=r"\[parallel\] tp must be an integer, got 'two'"):
        load_config(RECIPES / "debug_dense.toml", ["--parallel.tp", "two"])


@pytest.mark.parametrize(
    "args, pattern",
    [
        (["parallel.tp", "2"], r"must look like --section\.key value"),
        (["--parallel.tp"], r"'--parallel\.tp' has no value"),
        (["--parallel.tp", "--train.steps", "3"], r"'--parallel\.tp' has no value"),
        (["--tp=1.5"], r"must name a section and a key"),
        (["--parallel.=2"], r"must name a section and a key"),
        (["--.tp=2"], r"must name a section and a key"),
    ],
)
def test_malformed_overrides(args, pattern):
    with pytest.raises(ConfigError, match=pattern):
        parse_overrides(args)


# ---- property test: arbitrary edits either load or raise ConfigError, never anything else ----

SECTION_FIELDS = {
    "model": list(ModelConfig.__dataclass_fields__),
    "parallel": list(ParallelConfig.__dataclass_fields__),
    "train": list(TrainConfig.__dataclass_fields__),
    "data": list(DataConfig.__dataclass_fields__),
    "checkpoint": list(CheckpointConfig.__dataclass_fields__),
}
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-4, max_value=16),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["1f1b", "interleaved", "gpipe", "bfloat16", "float32", "bytes", "builtin", "silu"]),
)
values = st.one_of(scalars, st.lists(scalars, max_size=4), st.dictionaries(st.text(max_size=5), scalars, max_size=3))
sections = st.sampled_from(sorted(SECTION_FIELDS) + ["trian", ""])
keys = st.one_of(st.text(max_size=10), st.sampled_from([k for ks in SECTION_FIELDS.values() for k in ks]))
edit = st.tuples(sections, keys, values)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(DEBUG)), edits=st.lists(edit, min_size=1, max_size=4))
def test_random_edits_load_or_raise_config_error(name, edits):
    raw = copy.deepcopy(DEBUG[name])
    for section, key, value in edits:
        target = raw.setdefault(section, {})
        if isinstance(target, dict):
            target[key] = value
        else:
            raw[section] = value
    try:
        config_from_dict(raw, source=f"{name}.toml")
    except ConfigError as err:
        assert f"{name}.toml" in str(err)


override_text = st.one_of(
    st.text(max_size=12),
    st.integers().map(str),
    st.floats().map(str),
    st.sampled_from(["true", "false", "[1,3]", "[]", "'x'", "{a=1}", "1e400", "nan", "inf", "--x"]),
)


@settings(max_examples=200, deadline=None)
@given(
    name=st.sampled_from(sorted(DEBUG)),
    pairs=st.lists(st.tuples(sections, keys, override_text, st.booleans()), min_size=1, max_size=3),
)
def test_random_overrides_load_or_raise_config_error(name, pairs):
    args: list[str] = []
    for section, key, text, joined in pairs:
        flag = f"--{section}.{key}"
        args += [f"{flag}={text}"] if joined else [flag, text]
    try:
        load_config(RECIPES / f"{name}.toml", args)
    except ConfigError:
        pass


def test_messages_are_one_clear_sentence():
    with pytest.raises(ConfigError) as err:
        config_from_dict(edited("debug_dense", "parallel", "ep", 3), source="x.toml")
    assert re.match(r"^x\.toml: \[parallel\] ep = 3 needs an MoE model .*\.$", str(err.value))
