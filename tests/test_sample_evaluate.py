"""Sampling and evaluation of a trained checkpoint: the samplers' distributions, ``generate``
against greedy decoding by full forwards, ``python -m msar_jax.sample`` and ``python -m
msar_jax.evaluate`` on a run trained here, and each user error as one line.

One smoke MSAR run (2 layers, d = 32, 4 steps, checkpoints at steps 2 and 4) is trained per module
(``trained``); the CLIs run in-process through ``msar_jax.cli.run_cli`` (what ``python -m`` runs),
one of each also as a subprocess.
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from msar_jax import cli
from msar_jax import evaluate as evaluate_cli
from msar_jax import sample as sample_cli
from msar_jax.config import REPO_ROOT, load_config
from msar_jax.inference import sampling
from msar_jax.train import step as step_lib
from msar_jax.train import train
from msar_jax.train.metrics import read_jsonl

pytestmark = pytest.mark.usefixtures("fast_train_compile")

STEPS = 4


def smoke_config(spec="configs/msar.py:smoke=1,block_size=2", **overrides):
    base = {"train.steps": STEPS, "checkpoint.every": 2, "train.eval_every": 0, "train.eval_batches": 2,
            "train.eval_batch_size": 4, "train.progress": False, "train.tensorboard": False,
            "train.depth_weights": False, "model.max_seq_len": 64}
    return load_config(spec, base | overrides)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, fast_train_compile):
    """A smoke Block MSAR run (bytes tokenizer, seq_len 32, context 64) with checkpoints 2 and 4."""
    workdir = tmp_path_factory.mktemp("run")
    result = train(smoke_config(), workdir)
    assert result["step"] == STEPS
    return workdir


def cli_error(main, argv, capsys) -> str:
    """Run ``main`` as ``python -m`` does; assert one ``error:`` line on stderr and exit status 1;
    return the message."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        cli.run_cli(main, argv)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0].removeprefix("error: ")


# ---------------------------------------------------------------- samplers


def _support(logits, **kw):
    return set(np.flatnonzero(np.isfinite(np.asarray(sampling.filtered_logits(jnp.asarray(logits)[None], **kw))[0])))


def test_top_k_keeps_exactly_k_tokens_with_ties_broken_by_id():
    logits = np.array([1.0, 3.0, 2.0, 3.0, 0.5, 2.0], np.float32)
    assert _support(logits, top_k=1) == {1}
    assert _support(logits, top_k=3) == {1, 2, 3}  # ids 2 and 5 tie at 2.0: the lower id stays
    assert _support(logits, top_k=6) == _support(logits, top_k=0) == set(range(6))
    lp = np.asarray(sampling.filtered_log_probs(jnp.asarray(logits)[None], top_k=2))[0]
    np.testing.assert_allclose(np.exp(lp[[1, 3]]), [0.5, 0.5], rtol=1e-6)


def test_top_p_keeps_the_smallest_nucleus():
    probs = np.array([0.05, 0.5, 0.15, 0.3], np.float32)
    logits = np.log(probs)
    assert _support(logits, top_p=0.45) == {1}
    assert _support(logits, top_p=0.75) == {1, 3}
    assert _support(logits, top_p=0.81) == {1, 2, 3}
    assert _support(logits, top_p=0.99) == {0, 1, 2, 3}
    assert _support(logits, top_p=0.81, top_k=2) == {1, 3}  # top-k first, then the nucleus of the rest
    # Against a brute-force nucleus on random rows: the most likely tokens, as few as reach top_p.
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(64, 50)).astype(np.float32) * 2
    for top_p in (0.3, 0.7, 0.9):
        kept = np.isfinite(np.asarray(sampling.filtered_logits(jnp.asarray(rows), top_p=top_p)))
        p = np.exp(rows - rows.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        for r in range(rows.shape[0]):
            order = np.argsort(-p[r], kind="stable")
            need = int(np.searchsorted(np.cumsum(p[r, order]), top_p) + 1)
            assert set(np.flatnonzero(kept[r])) == set(order[:need])


def test_temperature_scales_and_zero_is_greedy():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(5, 40)).astype(np.float32))
    np.testing.assert_allclose(sampling.filtered_log_probs(logits, temperature=0.5),
                               jax.nn.log_softmax(logits / 0.5), atol=1e-6)
    greedy = np.argmax(np.asarray(logits), axis=-1)
    for seed in range(3):
        np.testing.assert_array_equal(sampling.sample(logits, jax.random.key(seed), temperature=0.0), greedy)
    one_hot = np.asarray(sampling.filtered_log_probs(logits, temperature=0.0))
    np.testing.assert_array_equal(np.argmax(one_hot, -1), greedy)
    assert (np.isfinite(one_hot).sum(-1) == 1).all()


def test_same_seed_same_tokens_and_draws_follow_the_distribution():
    logits = jnp.asarray(np.log(np.array([[0.1, 0.2, 0.3, 0.4]], np.float32)))
    a = sampling.sample(jnp.tile(logits, (64, 1)), jax.random.key(7))
    b = sampling.sample(jnp.tile(logits, (64, 1)), jax.random.key(7))
    c = sampling.sample(jnp.tile(logits, (64, 1)), jax.random.key(8))
    np.testing.assert_array_equal(a, b)
    assert (np.asarray(a) != np.asarray(c)).any()
    n = 40_000
    for kw, expected in (({}, [0.1, 0.2, 0.3, 0.4]), ({"top_k": 2}, [0, 0, 3 / 7, 4 / 7]),
                         ({"top_p": 0.6}, [0, 0, 3 / 7, 4 / 7]), ({"temperature": 2.0}, None)):
        draws = np.asarray(sampling.sample(jnp.tile(logits, (n, 1)), jax.random.key(0), **kw))
        freq = np.bincount(draws, minlength=4) / n
        if expected is None:
            expected = np.exp(np.asarray(jax.nn.log_softmax(logits[0] / 2.0)))
        np.testing.assert_allclose(freq, expected, atol=0.012)  # 4.5 sigma of a binomial at n = 40k


@pytest.mark.parametrize("kw,field", [({"temperature": -1.0}, "temperature"), ({"temperature": math.nan}, "temperature"),
                                      ({"top_k": -2}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p")])
def test_bad_sampling_settings_name_the_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field} = "):
        sampling.Sampling(**kw)


# ---------------------------------------------------------------- generate


def _greedy_by_full_forwards(model, prompt, n):
    """Greedy continuation recomputing the whole sequence for every token (the forward of all of
    it, padded to the context: causal, so the padding after the last token changes nothing)."""
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids)[0])
    context = int(model.cfg.max_seq_len)
    ids = list(prompt)
    for _ in range(n):
        padded = jnp.asarray([ids + [0] * (context - len(ids))], jnp.int32)
        ids.append(int(jnp.argmax(forward(state, padded)[0, len(ids) - 1])))
    return ids[len(prompt):]


@pytest.mark.parametrize("spec", ["configs/vanilla.py:smoke=1", "configs/msar.py:smoke=1,block_size=2"])
def test_generate_equals_greedy_full_forwards(spec):
    """Prompts of different lengths in one batch, each continued greedily through prefill and
    cached decoding steps: the tokens of recomputing the whole sequence for every new token."""
    config = smoke_config(spec)
    model_def, params = step_lib.init_model(config.model, seed=3)
    model = model_def.merge(params)
    prompts = [[5, 17, 99, 3, 42, 7, 200], [11, 250, 64]]
    n = 12
    streamed = []
    out = sampling.generate(model, prompts, max_new_tokens=n, temperature=0.0, seed=0,
                            on_token=lambda row, tok: streamed.append((row, tok)))
    for row, prompt in enumerate(prompts):
        assert out.tokens[row] == _greedy_by_full_forwards(model, prompt, n), row
        assert [t for r, t in streamed if r == row] == out.tokens[row]
    assert out.stopped_by == [None, None]
    # A stop token ends its row only: the row that meets it keeps the tokens before it.
    stop = out.tokens[0][4]
    first = out.tokens[0].index(stop)
    stopped = sampling.generate(model, prompts, max_new_tokens=n, temperature=0.0, stop_tokens=[stop])
    assert stopped.tokens[0] == out.tokens[0][:first] and stopped.stopped_by[0] == stop
    if stop not in out.tokens[1]:
        assert stopped.tokens[1] == out.tokens[1] and stopped.stopped_by[1] is None
    # Sampled: a seed fixes the output.
    kw = dict(max_new_tokens=n, temperature=1.0, top_k=20, top_p=0.9)
    a = sampling.generate(model, prompts, seed=1, **kw).tokens
    assert a == sampling.generate(model, prompts, seed=1, **kw).tokens
    assert a != sampling.generate(model, prompts, seed=2, **kw).tokens


def test_generate_rejects_prompts_that_do_not_fit():
    config = smoke_config()
    model_def, params = step_lib.init_model(config.model, seed=0)
    model = model_def.merge(params)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        sampling.generate(model, [[1], []], max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt 0 has 64 tokens; the context holds 64"):
        sampling.generate(model, [[1] * 64], max_new_tokens=2)
    with pytest.raises(ValueError, match="needs 70 positions"):
        sampling.generate(model, [[1] * 60], max_new_tokens=10)
    with pytest.raises(ValueError, match="token id 256, outside"):
        sampling.generate(model, [[1, 256]], max_new_tokens=1)


# ---------------------------------------------------------------- the sample CLI


def test_stream_decoder_holds_back_cut_characters():
    from msar_jax.data.tokenizers import ByteTokenizer

    text = "naïve 東京 ok"
    stream = sample_cli.StreamDecoder(ByteTokenizer())
    pieces = [stream.push(b) for b in text.encode("utf-8")]
    assert "".join(pieces) + stream.flush() == text
    assert "\ufffd" not in "".join(pieces)
    assert pieces[text.encode().index("東".encode()) + 1] == ""  # the first two bytes of 東 print nothing


def test_sample_prints_the_continuation(trained, capsys):
    out = io.StringIO()
    args = [f"--workdir={trained}", "--prompt=The whale", "--max_new_tokens=12", "--temperature=0"]
    result = sample_cli.main(args, out=out)
    from msar_jax.data.tokenizers import ByteTokenizer

    assert len(result.tokens[0]) == 12
    assert out.getvalue() == ByteTokenizer().decode(result.tokens[0]) + "\n"
    assert f"checkpoint {STEPS} of" in capsys.readouterr().err
    # The greedy continuation is the full-forward one of the checkpoint's params.
    from msar_jax.inference.loading import load_run

    run = load_run(trained)
    assert result.tokens[0] == _greedy_by_full_forwards(run.model(), list(b"The whale"), 12)
    # An older checkpoint, sampled with a seed: reproducible (the same shapes: nothing compiles again).
    args = [f"--workdir={trained}", "--prompt=Ahab said", "--max_new_tokens=12", "--checkpoint=2", "--top_k=40"]
    again = [sample_cli.main(args + [f"--seed={seed}"], out=io.StringIO()).tokens[0] for seed in (3, 3, 4)]
    assert again[0] == again[1] != again[2]


@pytest.mark.slow
def test_sample_cli_subprocess_streams_and_stops(trained):
    """The command line as a user runs it: the default length fills the context, a stop ends it."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=os.environ.get("MSAR_TEST_XLA_FLAGS", ""))
    cmd = [sys.executable, "-m", "msar_jax.sample", f"--workdir={trained}", "--prompt=Call me", "--temperature=0",
           "--stop= "]
    out = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "prompt 7 tokens, up to 57 new" in out.stderr
    assert " " not in out.stdout.rstrip("\n") and len(out.stdout) <= 58


# ---------------------------------------------------------------- the evaluate CLI


def test_evaluate_matches_the_runs_validation_loss(trained):
    """``--batches=train.eval_batches`` evaluates the windows training evaluated: the logged loss."""
    out = io.StringIO()
    result = evaluate_cli.main([f"--workdir={trained}", "--batches=2", "--json"], out=out)
    assert json.loads(out.getvalue()) == json.loads(json.dumps(result))
    logged = read_jsonl(trained, "eval")[-1]
    assert logged["step"] == STEPS == result["step"]
    assert result["loss"] == pytest.approx(logged["val_loss"], abs=2e-6)
    assert result["tokens"] == 2 * 4 * 32 and result["bytes"] == result["tokens"]  # bytes: 1 byte a token
    assert result["bits_per_byte"] == pytest.approx(result["loss"] / math.log(2))
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))
    dw = result["depth_weights"]
    assert dw["sources"] == ["emb", "b1", "b2", "partial"] and dw["streams"] == ["identity", "conv-4", "conv-8", "conv-12"]
    per_read = np.asarray(dw["per_read"])
    np.testing.assert_allclose(per_read.sum(axis=1), 1.0, atol=1e-5)  # each read: a softmax over sources
    np.testing.assert_allclose(np.asarray(dw["mean"]), per_read.mean(axis=0), atol=2e-6)


def test_evaluate_a_text_file_counts_every_target_once(trained, tmp_path):
    """A text of 2 full windows, 1 more full window than a batch holds... and a partial one: the
    summed loss is the full forward's over the same windows, and every byte is counted."""
    from msar_jax.inference.loading import load_run

    text = "It is not down on any map; true places never are. " * 4  # 200 bytes -> 6 windows + 7 targets
    path = tmp_path / "held_out.txt"
    path.write_text(text, encoding="utf-8")
    out = io.StringIO()
    result = evaluate_cli.main([f"--workdir={trained}", f"--data={path}"], out=out)
    tokens = np.frombuffer(text.strip().encode(), np.uint8).astype(np.int32)
    run = load_run(trained)
    forward = jax.jit(lambda params, ids: run.model_def.merge(params)(ids)[0])
    nats = 0.0
    for start in range(0, tokens.size - 1, 32):
        window = tokens[start:start + 33]
        logits = forward(run.params, jnp.asarray(window[None, :-1]))
        nats -= float(jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(logits[0]), window[1:, None], -1)))
    assert result["tokens"] == result["bytes"] == tokens.size - 1
    assert result["loss"] == pytest.approx(nats / (tokens.size - 1), rel=1e-5)
    assert result["batches"] == 3  # one full batch of 4 windows, the other 2 full windows, the tail
    report = out.getvalue()
    assert "bits/byte" in report and "conv-12" in report and report.count("\n") >= 10


def test_token_bytes_of_bpe_ids_counts_the_document_separator_as_two_bytes(bpe_folder):
    from msar_jax.data.tokenizers import load_tokenizer

    tok = load_tokenizer(bpe_folder)
    docs = ["Über the sea — a whale!", "second document"]
    ids = evaluate_cli.encode_documents(docs, tok)
    assert (ids == tok.eot_id).sum() == 1
    assert evaluate_cli.token_bytes(tok, ids) == len("\n\n".join(docs).encode("utf-8"))


def test_report_of_a_mechanism_without_depth_weights():
    report = evaluate_cli.format_report({"step": 3, "workdir": "w", "mechanism": "vanilla", "tokenizer": "bytes",
                                         "data": "d", "tokens": 10, "bytes": 10, "batches": 1, "loss": 1.0,
                                         "perplexity": math.e, "bits_per_byte": 1 / math.log(2),
                                         "depth_weights": None})
    assert "depth weights: none (vanilla has no depth attention)" in report


# ---------------------------------------------------------------- user errors, one line each


@pytest.fixture(scope="module")
def bpe_folder(tmp_path_factory):
    """A data folder prepared with a 300-token BPE (another tokenizer than the trained run's)."""
    from msar_jax import data

    src = tmp_path_factory.mktemp("bpe_source")
    words = "whale sea ship captain harpoon ocean deck sail storm island".split()
    rng = np.random.default_rng(0)
    for i in range(24):
        (src / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(words, 200)) + ".\n", encoding="utf-8")
    out = tmp_path_factory.mktemp("bpe_data")
    data.prepare(str(src), out, tokenizer="bpe", vocab_size=300)
    return out


def _copy_run(trained, tmp_path, edit):
    """A copy of the trained run with ``edit(config_json_dict)`` applied to its config.json."""
    copy = tmp_path / "copy"
    shutil.copytree(trained, copy)
    record = json.loads((copy / "config.json").read_text())
    edit(record)
    (copy / "config.json").write_text(json.dumps(record))
    return copy


def test_error_empty_prompt(trained, capsys):
    assert cli_error(sample_cli.main, [f"--workdir={trained}", "--prompt="], capsys) == (
        "--prompt is empty: give the text to continue (at least one character)")


def test_error_prompt_longer_than_the_context(trained, capsys):
    msg = cli_error(sample_cli.main, [f"--workdir={trained}", "--prompt=" + "x" * 64], capsys)
    assert msg.startswith("--prompt is 64 tokens (bytes tokenizer), longer than the model's context allows: "
                          "model.max_seq_len = 64 holds at most 63 prompt tokens")
    msg = cli_error(sample_cli.main, [f"--workdir={trained}", "--prompt=" + "x" * 60, "--max_new_tokens=5"], capsys)
    assert msg.startswith("--max_new_tokens=5: the prompt's 60 tokens plus 5 new ones exceed the model's context "
                          "of 64 tokens (model.max_seq_len); at most 4 fit")


@pytest.mark.parametrize("main,extra", [(sample_cli.main, ["--prompt=hi"]), (evaluate_cli.main, [])])
def test_error_workdir_without_a_checkpoint(trained, tmp_path, capsys, main, extra):
    empty = tmp_path / "fresh"
    empty.mkdir()
    shutil.copy(trained / "config.json", empty / "config.json")
    assert cli_error(main, [f"--workdir={empty}", *extra], capsys) == (
        f"--workdir={empty}: no checkpoint in {empty / 'checkpoints'} (a run saves one every checkpoint.every "
        "steps and when it ends)")
    (empty / "config.json").unlink()
    assert cli_error(main, [f"--workdir={empty}", *extra], capsys).startswith(
        f"--workdir={empty}: no config.json, so not a training run folder")
    assert cli_error(main, [f"--workdir={tmp_path / 'missing'}", *extra], capsys) == (
        f"--workdir={tmp_path / 'missing'}: no such folder")
    assert cli_error(main, [f"--workdir={trained}", "--checkpoint=3", *extra], capsys).startswith(
        "checkpoint step 3: no such checkpoint in")
    assert not (empty / "checkpoints").exists()  # reading a run folder writes nothing into it


def test_error_checkpoint_of_another_config(trained, tmp_path, capsys):
    copy = _copy_run(trained, tmp_path, lambda r: r["model"].update(mlp_dim=96))
    msg = cli_error(sample_cli.main, [f"--workdir={copy}", "--prompt=hi"], capsys)
    assert msg == (f"checkpoint {STEPS} in {copy / 'checkpoints'} is of another model config than "
                   f"{copy / 'config.json'} (checkpoint -> config.json): model.mlp_dim: 64 -> 96; its params do "
                   "not fit that model")
    assert cli_error(evaluate_cli.main, [f"--workdir={copy}"], capsys) == msg


def test_error_tokenizer_that_does_not_match_the_checkpoint(trained, tmp_path, capsys, bpe_folder):
    # Held-out data prepared with another tokenizer.
    msg = cli_error(evaluate_cli.main, [f"--workdir={trained}", f"--data={bpe_folder}"], capsys)
    assert msg.startswith(f"data folder {bpe_folder} does not match the checkpoint's tokenizer: it holds bpe "
                          "tokens (vocab 300, tokenizer.json sha256 ")
    assert msg.endswith("the run trained on bytes tokens (vocab 256) (config.json data_used)")

    # The run's data folder holds other data now (prepared again with another tokenizer).
    def moved(record):
        record["data_used"]["dir"] = str(bpe_folder)

    assert cli_error(evaluate_cli.main, [f"--workdir={_copy_run(trained, tmp_path, moved)}", "--batches=1"],
                     capsys) == msg

    # A BPE run whose tokenizer.json was replaced by another vocabulary.
    def bpe_run(record):
        record["data_used"].update(tokenizer="bpe", vocab_size=300, dir=str(bpe_folder),
                                   files_sha256={"tokenizer": "ab" * 32})

    shutil.rmtree(tmp_path / "copy")
    msg = cli_error(sample_cli.main, [f"--workdir={_copy_run(trained, tmp_path, bpe_run)}", "--prompt=hi"], capsys)
    assert msg.startswith(f"tokenizer {bpe_folder / 'tokenizer.json'} does not match the checkpoint's data: the "
                          "folder holds bpe tokens (vocab 300, tokenizer.json sha256 ")
    assert "the run trained on bpe tokens (vocab 300, tokenizer.json sha256 abababababab...)" in msg


def test_error_data_file_that_is_not_text(trained, tmp_path, capsys):
    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)))
    assert cli_error(evaluate_cli.main, [f"--workdir={trained}", f"--data={binary}"], capsys) == (
        f"--data={binary}: not a text file: a NUL byte at byte offset 7: a binary file, not text "
        "(evaluate reads UTF-8 text)")
    latin = tmp_path / "latin.txt"
    latin.write_bytes("café au lait".encode("latin-1"))
    assert cli_error(evaluate_cli.main, [f"--workdir={trained}", f"--data={latin}"], capsys).startswith(
        f"--data={latin}: not a text file: not valid utf-8 text: byte 0xE9 at byte offset 3")
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("fine text", encoding="utf-8")
    (folder / "b.txt").write_bytes(b"\x00\x01binary")
    assert cli_error(evaluate_cli.main, [f"--workdir={trained}", f"--data={folder}"], capsys).startswith(
        f"--data={folder}: {folder / 'b.txt'} is not text: a NUL byte at byte offset 0")
    assert cli_error(evaluate_cli.main, [f"--workdir={trained}", f"--data={tmp_path / 'nope.txt'}"], capsys) == (
        f"--data={tmp_path / 'nope.txt'}: no such file or folder")


def test_error_stop_text_of_several_tokens(trained, capsys):
    assert cli_error(sample_cli.main, [f"--workdir={trained}", "--prompt=hi", "--stop=ab"], capsys) == (
        "--stop='ab': encodes to 2 tokens with the checkpoint's bytes tokenizer; a stop must be exactly one token")


def test_evaluate_cli_subprocess_error_is_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "msar_jax.evaluate", f"--workdir={tmp_path}"], cwd=REPO_ROOT,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip() == f"error: --workdir={tmp_path}: no config.json, so not a training run folder " \
                                 "(python -m msar_jax.train --workdir=... writes one)"


def test_demo_ends_with_a_sample_of_its_checkpoint(trained, capsys):
    from msar_jax import demo

    text = demo.sample_from(trained, "The whale", max_new_tokens=12)
    assert text == demo.sample_from(trained, "The whale", max_new_tokens=12)  # seeded
    assert isinstance(text, str) and text
    # Prompt errors stop the demo before it trains.
    assert cli_error(demo.main, ["--prompt="], capsys) == (
        "flag '--prompt' = '': must not be empty (or leave the flag out)")
    assert cli_error(demo.main, ["--prompt=" + "x" * 128], capsys).startswith(
        "flag '--prompt' = 'xxxx")


def test_evaluate_warns_when_the_runs_val_split_changed(trained, tmp_path, capsys):
    def other_val(record):
        record["data_used"]["files_sha256"]["val"] = "cd" * 32

    result = evaluate_cli.main([f"--workdir={_copy_run(trained, tmp_path, other_val)}", "--batches=1"],
                               out=io.StringIO())
    err = capsys.readouterr().err
    assert "warning: the val split in" in err and "config.json data_used records cdcdcdcdcdcd..." in err
    assert result["batches"] == 1
