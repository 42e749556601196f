"""Every CLI that takes a config prints a user's config error as one line naming the field, the
value and the rule (a typo names the close keys), exits non-zero and shows no traceback.

The bad inputs: a ``:key=value`` argument that breaks a model rule (``block_size=3``,
``streams=0``), an unknown size, a value of the wrong type, a mistyped key (``:sise``), a mistyped
override (``--config.optim.lrr``) and a missing file. Each is run through a subprocess of one CLI
(``msar_jax.accounting``, ``msar_jax.train`` or ``msar_jax.compile_check``; each costs a jax
import, ~3 s), and the shared parsing behind all of them (``msar_jax.cli.check_config_flags``,
``load_config``) is checked in-process for every input.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from msar_jax import config as config_lib
from msar_jax import cli
from msar_jax.config import REPO_ROOT

MSAR = "--config=configs/msar.py"
# (arguments, the start of the one-line message); messages as a user sees them after "error: ".
CASES = {
    "block_size=3": ([f"{MSAR}:smoke=1,block_size=3"],
                     "config field 'model.residual.block_size' = 3: must be 1 (Full mode) or even"),
    "streams=0": ([f"{MSAR}:streams=0"], "config field 'model.residual.streams' = 0: must be a positive integer"),
    "size=huge": ([f"{MSAR}:size=huge"], "config argument 'size' = 'huge': must be one of base, ladder_1,"),
    "smoke=yes": ([f"{MSAR}:smoke=yes"], "config argument 'smoke' = 'yes': must be an integer"),
    "sise=tiny": ([f"{MSAR}:sise=tiny"], "config argument 'sise' = 'tiny': unknown key; did you mean 'size'?"),
    "optim.lrr": ([f"{MSAR}:smoke=1", "--config.optim.lrr=1e-3"],
                  "config field 'optim.lrr' = '1e-3': no such config field (optim has no field 'lrr'); "
                  "did you mean 'optim.lr'?"),
    "missing file": (["--config=configs/no_such_config.py:smoke=1"],
                     "config file 'configs/no_such_config.py': no such file (looked in "),
}


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def assert_one_line_error(out: subprocess.CompletedProcess, message: str, *, only_line: bool = True) -> None:
    """Non-zero exit, no traceback, exactly one ``error:`` line and it starts with ``message``
    (with ``only_line``, the whole of stderr is that line)."""
    assert out.returncode != 0, out.stdout[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1, out.stderr[-3000:]
    if only_line:
        assert lines == errors, out.stderr[-3000:]
    text = errors[0].split("error: ", 1)[1]
    assert text.startswith(message), text


@pytest.mark.parametrize("case", ["streams=0", "size=huge", "smoke=yes", "sise=tiny"])
def test_accounting_cli(case):
    args, message = CASES[case]
    assert_one_line_error(_run("msar_jax.accounting", *args), message)


def test_accounting_rejects_a_non_positive_seq_len():
    """It printed a report with negative attention FLOPs."""
    out = _run("msar_jax.accounting", f"{MSAR}:smoke=1", "--seq_len=-1")
    assert_one_line_error(out, "flag --seq_len=-1: -1 is not a positive integer")
    assert_one_line_error(_run("msar_jax.accounting", f"{MSAR}:smoke=1", "--config.seq_len=0"),
                          "config field 'seq_len' = 0: must be a positive integer")


@pytest.mark.parametrize("case", ["block_size=3", "optim.lrr", "missing file"])
def test_train_cli(case, tmp_path):
    args, message = CASES[case]
    out = _run("msar_jax.train", *args, f"--workdir={tmp_path / 'run'}")
    assert_one_line_error(out, message)
    assert not (tmp_path / "run").exists()  # nothing written for a config that does not load


def test_compile_check_cli():
    """argparse-based: the override parser is its own, so the override typo is the case."""
    args, message = CASES["optim.lrr"]
    out = _run("msar_jax.compile_check", *args)
    assert_one_line_error(out, message.replace("'1e-3'", "0.001"))


@pytest.mark.parametrize("case", list(CASES))
def test_shared_config_flag_check_names_every_case(case):
    """What ``run_absl_cli`` checks before absl parses (train and accounting); the argparse CLIs
    reach the same messages through ``load_config``."""
    args, message = CASES[case]
    with pytest.raises(config_lib.ConfigError) as err:
        cli.check_config_flags(["prog", *args])
    assert cli.config_error_line(err.value).startswith(message)
    spec = args[0].split("=", 1)[1]
    overrides = config_lib.parse_overrides(a[len("--config."):] for a in args[1:])
    with pytest.raises(config_lib.ConfigError) as err:
        config_lib.load_config(spec, overrides)
    assert cli.config_error_line(err.value).startswith(message.replace("'1e-3'", "0.001"))


def test_config_flag_forms_and_repository_relative_paths(tmp_path, monkeypatch):
    """``--config X`` and ``--config=X``, boolean overrides, and a path under the repository
    root given from another folder (made absolute for ml-collections, which looks only in .)."""
    monkeypatch.chdir(tmp_path)
    argv = cli.check_config_flags(["prog", "--config", "configs/msar.py:smoke=1", "--config.train.progress",
                                       "--noconfig.model.residual.conv", "--config.optim.lr", "0.1"])
    assert argv[2] == f"{REPO_ROOT / 'configs/msar.py'}:smoke=1"
    with pytest.raises(config_lib.ConfigError, match=r"'train\.progres' = None: .*did you mean 'train\.progress'"):
        cli.check_config_flags(["prog", "--config=configs/msar.py", "--config.train.progres"])


def test_an_error_inside_ml_collections_flag_parsing_is_found():
    """Without the up-front check, ml-collections re-raises ``get_config``'s error as
    ``type(e)("Error whilst parsing config file:" + traceback)`` and absl wraps that again; the
    original ``ConfigError`` is still in the chain, and its one line is what the CLIs print."""
    from absl import flags
    from ml_collections import config_flags

    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=flag_values)
    with pytest.raises(flags.Error) as err:
        flag_values(["prog", f"{MSAR}:smoke=1,block_size=3"])
    assert "Traceback" in str(err.value)  # what absl alone would print
    assert cli.config_error_line(err.value).startswith(CASES["block_size=3"][1])


def test_argparse_clis_print_one_line(tmp_path, capsys):
    from msar_jax.experiments import ablation, scaling

    bad_runs = [
        (ablation.main, [f"--workdir={tmp_path}", "--dry_run", "--set", "optim.lrr=1e-3"], CASES["optim.lrr"][1]),
        (ablation.main, [f"--workdir={tmp_path}", "--dry_run", "--size=huge"], CASES["size=huge"][1]),
        (scaling.main, [f"--workdir={tmp_path}", "--train", "--methods=vanilla", "--rungs=ladder_1",
                        "--set", "optim.lrr=1e-3"], CASES["optim.lrr"][1]),
    ]
    for main, argv, message in bad_runs:
        with pytest.raises(SystemExit) as exit_:
            cli.run_cli(main, argv)
        assert exit_.value.code == 1
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: " + message.replace("'1e-3'", "0.001")), lines
    for main, argv, flag in [(ablation.main, [f"--workdir={tmp_path}", "--seeds=0"], "--seeds"),
                             (ablation.main, [f"--workdir={tmp_path}", "--shard=3/2"], "--shard"),
                             (scaling.main, [f"--workdir={tmp_path}", "--steps=-5"], "--steps"),
                             (scaling.main, [f"--workdir={tmp_path}", "--rungs=ladder_9"], "--rungs")]:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and sum("error:" in line for line in err.splitlines()) == 1 and flag in err
