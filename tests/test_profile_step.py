"""benchmarks/profile_step.py: op attribution rules, and a traced CPU step attributed to the
model's named scopes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "profile_step.py"


@pytest.fixture(scope="module")
def prof():
    spec = importlib.util.spec_from_file_location("profile_step_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("op_name, part, pass_", [
    ("jit(train_step)/jvp()/while/body/eval_jaxpr/depth_read/mul", "depth_read", "forward"),
    ("jit(train_step)/transpose(jvp(cross_entropy))/jit(log_softmax)", "cross_entropy", "backward"),
    ("jit(train_step)/jvp(cross_entropy)/jit(log_softmax)/reduce_max", "cross_entropy", "forward"),
    ("jit(train_step)/transpose(jvp())/while/body/eval_jaxpr/transpose(jvp(depth_begin_block))"
     "/jvp(depth_begin_block)/checkpoint/while/body/add", "depth_begin_block", "recompute"),
    ("jit(train_step)/transpose(jvp())/while/body/eval_jaxpr/jvp()/while/body/sublayer_attn/dot_general",
     "sublayer_attn", "recompute"),
    ("jit(train_step)/transpose(jvp())/x/transpose(jvp(jvp()))/checkpoint/sublayer_dense/rsqrt",
     "sublayer_dense", "backward"),
    ("jit(train_step)/optimizer/mul", "optimizer", "other"),
    ("jit(train_step)/depth_reader_not_a_scope/mul", "other", "other"),
    ("", "other", "other"),
])
def test_attribution_rules(prof, op_name, part, pass_):
    assert (prof.part_of(op_name), prof.pass_of(op_name)) == (part, pass_)


@pytest.mark.parametrize("op_name, kernel", [
    ("jit(train_step)/transpose(jvp())/while/body/eval_jaxpr/depth_read/depth_read/checkpoint/"
     "depth_attention_phase2_bwd_inputs/pallas_call", "depth_attention_phase2_bwd_inputs"),
    ("jit(f)/my_kernel/pallas_call", "my_kernel"),
    ("jit(train_step)/jvp()/depth_read/checkpoint/depth_attention_mix_mean/while/body/add",  # interpret mode
     "depth_attention_mix_mean"),
    ("jit(train_step)/jvp()/depth_read/add", None),
    ("", None),
])
def test_pallas_kernel_names(prof, op_name, kernel):
    assert prof.kernel_of(op_name) == kernel


def test_hlo_kinds(prof):
    def f(a, b):
        return jnp.tanh(a @ b).sum() + jnp.transpose(a).sum()

    text = jax.jit(f).lower(jnp.ones((64, 64)), jnp.ones((64, 64))).compile().as_text()
    hlo = prof.parse_hlo(text)
    comps = hlo["__computations__"]
    kinds = {prof.kind_of(info, comps) for name, info in hlo.items() if name != "__computations__"}
    assert "matmul" in kinds
    assert prof.kind_of(None, comps) == "other"


# The profiler's end-to-end runs (15-26 s each) are in the slow suite, which CI runs after the
# default one; its attribution and HLO rules are checked above.
@pytest.mark.slow
def test_profile_smoke_attnres(prof, tmp_path):
    rows = prof.main(["configs/attnres.py:smoke=1", "--steps=1", "--warmup=0", "--top=3",
                      f"--trace_root={tmp_path}", f"--json={tmp_path / 'p.json'}", f"--hlo_dir={tmp_path / 'hlo'}"])
    (row,) = rows
    assert row["busy_ms_per_step"] > 0 and row["median_step_ms"] > 0
    assert row["unmatched_share"] < 0.05  # trace ops are found in the compiled HLO
    parts = {key.split("|")[0] for key in row["parts"]}
    assert {"depth_read", "sublayer_attn", "sublayer_dense", "lm_head"} <= parts
    assert sum(row["parts"].values()) == pytest.approx(sum(row["kinds"].values()), rel=1e-9)
    assert sum(row["kinds"].values()) == pytest.approx(row["busy_ms_per_step"], rel=1e-9)
    assert (tmp_path / "p.json").exists()
    import gzip

    (hlo_file,) = (tmp_path / "hlo").glob("*.hlo.txt.gz")
    hlo_text = gzip.open(hlo_file, "rt").read()
    assert "HloModule" in hlo_text and row["top_ops"][0]["op"] in hlo_text  # the report's ops are in it
    assert row["pallas_kernels"] == {}  # the XLA read: no Pallas kernel


@pytest.mark.slow
def test_profile_names_pallas_kernels(prof, tmp_path):
    """The per-kernel table, on the interpret-mode GPU kernels of a smoke-size AttnRes step."""
    (row,) = prof.main(["configs/attnres.py:smoke=1", "--steps=1", "--warmup=0", f"--trace_root={tmp_path}",
                        "--set", "model.residual.implementation=pallas_gpu"])
    kernels = row["pallas_kernels"]
    assert {"depth_attention_scores", "depth_attention_mix_mean"} <= set(kernels), sorted(kernels)
    assert all(v["ms_per_step"] > 0 and v["calls_per_step"] >= 1 for v in kernels.values())


def test_kernel_options_set_module_defaults(prof, monkeypatch):
    """``--kernel-option MODULE.NAME=VALUE`` sets a kernel module's default (a literal or a
    string), and refuses a malformed item, an unknown module or a name the module lacks."""
    from pallas_kernels.depth_attention import fused_bwd_phase1, heuristics

    monkeypatch.setattr(fused_bwd_phase1, "DEFAULT_QUERY_GRADS_HEADS", fused_bwd_phase1.DEFAULT_QUERY_GRADS_HEADS)
    monkeypatch.setattr(heuristics, "AUTO_INPUTS", heuristics.AUTO_INPUTS)
    got = prof.set_kernel_options(["fused_bwd_phase1.DEFAULT_QUERY_GRADS_HEADS=all_heads", "heuristics.AUTO_INPUTS=False"])
    assert got == {"fused_bwd_phase1.DEFAULT_QUERY_GRADS_HEADS": "all_heads", "heuristics.AUTO_INPUTS": False}
    assert (fused_bwd_phase1.DEFAULT_QUERY_GRADS_HEADS, heuristics.AUTO_INPUTS) == ("all_heads", False)
    for bad, match in (("AUTO_INPUTS=False", "must be MODULE.NAME=VALUE"),
                       ("heuristics.AUTO_INPUTS", "must be MODULE.NAME=VALUE"),
                       ("no_such_module.X=1", "no module"),
                       ("heuristics.AUTO_INPUT=False", "heuristics has no AUTO_INPUT")):
        with pytest.raises(ValueError, match=match):
            prof.set_kernel_options([bad])


def test_step_ratios_divide_by_the_vanilla_of_the_same_run(prof):
    """The closing table: each config's step over the Vanilla timed in the same process; none
    without a Vanilla config."""
    rows = [{"config": "configs/vanilla.py:size=base", "device": "H100", "median_step_ms": 1000.0, "peak_gib": 22.9},
            {"config": "configs/msar.py:size=base", "device": "H100", "median_step_ms": 1389.0, "peak_gib": None}]
    table = prof.step_ratios(rows)
    assert "| configs/msar.py:size=base | 1389.0 | 1.389 | n/a |" in table
    assert "| configs/vanilla.py:size=base | 1000.0 | 1.000 | 22.90 |" in table
    assert prof.step_ratios(rows[1:]) == ""
