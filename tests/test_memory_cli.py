"""`fsdp-lab memory` through the real CLI dispatcher: the article's numbers, the table and bad flags."""
import re

import pytest

from fsdp_lab import cli
from fsdp_lab.theory import planner


def run_memory(capsys, *argv):
    code = cli.main(["memory", *argv])
    out = capsys.readouterr().out
    return code, out


def test_article_example(capsys):
    code, out = run_memory(capsys, "--params", "7e9", "--gpus", "8", "--gpu-mem", "80")
    assert code == 0
    assert "112 GB per GPU, which does not fit one 80 GB card" in out
    assert "16Φ/N = 14 GB per GPU on 8 GPUs" in out
    assert "= 2 GPUs (the article's count" in out
    assert "needs N_min = 2 GPUs" in out
    assert "Plan for 2–3 GPUs." in out
    # the activation assumptions are printed, not hidden
    for needle in ("seq 2048", "micro-batch 1", "fused attention", "layers=32", "hidden=4096", "20%"):
        assert needle in out, needle


def test_attention_and_vocab_flags(capsys):
    """--attention materialized is the article's s×s-score model; --vocab sizes the logits (Qwen: 151,936)."""
    _code, kept = run_memory(capsys, "--attention", "materialized")
    assert "Korthikanti" in kept and "Plan for 3–4 GPUs." in kept
    _code, long_fused = run_memory(capsys, "--seq-len", "4096")
    _code, long_kept = run_memory(capsys, "--seq-len", "4096", "--attention", "materialized")
    assert "Plan for 2–3 GPUs." in long_fused and "none (one layer" in long_kept
    _code, qwen = run_memory(capsys, "--params", "14B", "--gpus", "4", "--vocab", "151936")
    assert f"vocab 151,936): {planner.plan(14e9, 4, 80, vocab=151936).logits_bytes / 1e9:.2f} GB" in qwen


def test_table_has_every_stage_with_its_bytes_and_verdict(capsys):
    def rows(out):
        return {m.group(1): (float(m.group(2)), m.group(3).strip())
                for m in re.finditer(r"^\s+(DDP|ZeRO-[123])\s.*?([\d.]+) GB\s+[\d.]+ GB\s+(.+)$", out, re.M)}
    _code, out = run_memory(capsys, "--params", "7e9", "--gpus", "8", "--gpu-mem", "80")
    assert rows(out) == {"DDP": (112.0, "no"), "ZeRO-1": (63.0, "yes"), "ZeRO-2": (38.5, "yes"),
                         "ZeRO-3": (14.0, "yes")}
    _code, out = run_memory(capsys, "--params", "7e9", "--gpus", "8", "--gpu-mem", "80", "--seq-len", "4096")
    assert rows(out)["ZeRO-1"] == (63.0, "state only")  # 63 GB of state + 19.8 GB of activations and logits


def test_numbers_come_from_plan(capsys):
    _code, out = run_memory(capsys, "--params", "13B", "--gpus", "4", "--gpu-mem", "80", "--seq-len", "1024")
    p = planner.plan(13e9, 4, 80, seq_len=1024)
    assert (p.n_min, p.n_min_with_activations) == (3, 3)
    assert f"= {p.n_min} GPUs (the article" in out
    assert f"needs N_min = {p.n_min_with_activations} GPUs" in out
    assert f"{p.zero3_bytes / 1e9:.2f} GB" in out


def test_recompute_lowers_the_activation_count(capsys):
    _code, out = run_memory(capsys, "--params", "7e9", "--gpus", "8", "--gpu-mem", "80", "--recompute")
    assert "needs N_min = 2 GPUs" in out and "2·s·b·h" in out


def test_seq_len_changes_the_answer(capsys):
    _code, short = run_memory(capsys, "--seq-len", "512")
    _code, long = run_memory(capsys, "--seq-len", "8192", "--attention", "materialized")
    assert "needs N_min = 2 GPUs" in short
    assert "none (one layer plus the activations already exceed a card)" in long


@pytest.mark.parametrize("argv, needle", [
    (["--gpus", "0"], "--gpus: expected a positive integer, got 0"),
    (["--gpus", "-3"], "--gpus: expected a positive integer, got -3"),
    (["--gpus", "eight"], "--gpus: expected a positive integer, got 'eight'"),
    (["--params", "abc"], "--params: expected a parameter count"),
    (["--params", "-7e9"], "--params"),
    (["--params", "0"], "--params: the parameter count must be at least 1"),
    (["--gpu-mem", "0"], "--gpu-mem: expected a positive number, got '0'"),
    (["--gpu-mem", "nan"], "--gpu-mem: expected a positive number, got 'nan'"),
    (["--seq-len", "-1"], "--seq-len"),
    (["--micro-batch", "0"], "--micro-batch"),
    (["--reserve", "1.5"], "--reserve"),
])
def test_bad_flags_exit_2_with_a_clear_message(capsys, argv, needle):
    with pytest.raises(SystemExit) as exc:
        cli.main(["memory", *argv])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_runs_as_a_module():
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "fsdp_lab", "memory", "--params", "7e9", "--gpus", "8",
                           "--gpu-mem", "80"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "112 GB" in done.stdout and "14 GB" in done.stdout



@pytest.mark.parametrize("flag", ["--params", "--gpus", "--seq-len", "--micro-batch", "--vocab", "--layers"])
def test_a_number_of_hundreds_of_digits_is_refused_by_name(capsys, flag):
    """Python ints have no ceiling, and math.isfinite() of a 400-digit one raises OverflowError: every count is
    refused above the planner's ceiling with one line naming it, never a traceback."""
    try:
        code = cli.main(["memory", flag, "1" + "0" * 400])
    except SystemExit as exc:  # argparse's own refusal (--params is checked at parse time)
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err and "OverflowError" not in err
    name = flag.lstrip("-").replace("-", "_")
    assert ("the parameter count must be at most 1e+18" if flag == "--params"
            else f"{name} is too large to plan with (401 digits; at most 1e+18)") in err


def test_huge_plans_keep_their_columns(capsys):
    """At 1e18 parameters the numbers are 14 digits: every row still parses back into its five columns, and
    the shape line prints Φ in plain scientific notation (it printed "1e+09e9")."""
    code, out = run_memory(capsys, "--params", "1e18")
    assert code == 0
    header, *rows = out.split("Per GPU on N = 8:\n")[1].splitlines()[:5]
    assert re.match(r"\s+stage\s+formula\s+state\s+\+ layer \+ activations\s+fits 80 GB\?$", header)
    for row in rows:
        fields = re.fullmatch(r"\s+(\S+)\s+(.+?)\s+([0-9.]+) GB\s+([0-9.]+) GB\s+(yes|no|state only)", row)
        assert fields, row
        assert float(fields.group(4)) >= float(fields.group(3)) > 1e9
    assert "16000000000.00 GB" in out
    assert "of Φ = 1e+18 sits in the blocks" in out and "e9 of Φ" not in out
