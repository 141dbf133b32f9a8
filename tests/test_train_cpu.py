"""CPU tests of ``coda-cute train --tiny``: three short runs on the reference path, the log, the plot;
two ranks under torchrun (FSDP2, DDP on gloo) against one process on the same sequences."""

import json
import socket
import subprocess
import sys

import pytest
import torch

from coda_cute import train as T
from coda_cute.cli import main as cli_main

pytest.importorskip("transformers")


def test_corpus_is_the_stdlib_sources_every_twentieth_file_held_out():
    files = T.corpus_files()
    assert files == sorted(files) and all(p.suffix == ".py" for p in files)
    assert not any("site-packages" in p.parts for p in files)
    joined = [p.read_bytes() + b"\n" for p in files[:40]]
    train, val = T.corpus_split(0.05, limit=sum(map(len, joined)))
    assert bytes(val.numpy()) == joined[19] + joined[39]
    assert bytes(train.numpy()) == b"".join(joined[:19] + joined[20:39])
    train, val = T.corpus_split(0.25, limit=50_000)
    assert len(train) + len(val) == 50_000 and len(val) > 0


def test_last_evaluation_covers_the_split_once():
    data = torch.arange(1, 1002) % 256
    w = T.consecutive_windows(data, 100, 10**6)
    assert w.shape == (10, 101) and torch.equal(w[:, 1:].flatten(), data[1:1001].long())
    assert T.consecutive_windows(data, 100, 300).shape == (3, 101)


def test_schedule_warms_up_then_decays_to_its_floor():
    cfg = T.TrainConfig(steps=100, warmup=10, lr=1e-3, min_lr_ratio=0.1)
    lrs = [T.lr_at(s, cfg) for s in range(cfg.steps)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:])) and lrs[-1] == pytest.approx(1e-4)


def test_tiny_run_trains_hf_and_coda_alike(tmp_path):
    rc = cli_main(["train", "--tiny", "--steps", "4", "--out", str(tmp_path)])
    assert rc == 0
    log = json.loads((tmp_path / "train_log.json").read_text())
    runs = {r["label"]: r for r in log["runs"]}
    assert set(runs) == {"hf", "hf_seed2", "coda"} and all(len(r["steps"]) == 4 for r in runs.values())
    hf, coda = runs["hf"], runs["coda"]
    assert hf["steps"][-1]["loss"] < hf["steps"][0]["loss"]  # it learns
    for a, b in zip(hf["steps"], coda["steps"]):  # same weights, same data: the same losses
        assert abs(a["loss"] - b["loss"]) < 1e-2 * a["loss"]
    assert abs(hf["final_val_loss"] - coda["final_val_loss"]) < 1e-2 * hf["final_val_loss"]
    assert hf["evals"][-1]["tokens"] == 2048 and all(s["grad_norm"] > 0 for s in hf["steps"])
    assert (tmp_path / "loss_curves.png").stat().st_size > 10_000


def test_bad_steps_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["train", "--tiny", "--steps", "0", "--out", str(tmp_path)])
    assert exc.value.code == 2 and "argument --steps: must be a positive integer" in capsys.readouterr().err


def test_cuda_graphs_need_a_gpu(tmp_path, capsys):
    assert cli_main(["train", "--tiny", "--cuda-graphs", "--out", str(tmp_path)]) == 2
    assert "--cuda-graphs needs a CUDA GPU" in capsys.readouterr().out


@pytest.fixture(scope="module")
def one_process_of_four(tmp_path_factory):
    """The tiny runs in one process on 4 sequences per micro-batch: two ranks' global batch."""
    out = tmp_path_factory.mktemp("one")
    assert cli_main(["train", "--tiny", "--no-spread", "--steps", "4", "--micro-batch", "4", "--out", str(out)]) == 0
    return json.loads((out / "train_log.json").read_text())


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_torchrun_ranks_train_like_one_process_on_the_same_sequences(mode, tmp_path, one_process_of_four):
    """``torchrun --nproc_per_node 2 -m coda_cute.train --tiny --<mode>``: 2 sequences per rank and
    micro-batch, losses (means over the ranks) equal to one process's on the same 4 sequences,
    one log written by rank 0."""
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    free = port.getsockname()[1]
    port.close()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free),
           "-m", "coda_cute.train", "--tiny", "--no-spread", "--steps", "4", "--micro-batch", "2", f"--{mode}",
           "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("coda-cute train: 4 steps") == 1  # the table from rank 0 only
    log = json.loads((tmp_path / "train_log.json").read_text())
    assert log["parallel"] == mode and log["config"]["world"] == 2
    want = {r["label"]: r for r in one_process_of_four["runs"]}
    for run in log["runs"]:
        ref = want[run["label"].removesuffix(f"+{mode}")]
        for a, b in zip(run["steps"], ref["steps"], strict=True):
            assert abs(a["loss"] - b["loss"]) < 2e-3 * b["loss"], (run["label"], a, b)
        assert abs(run["final_val_loss"] - ref["final_val_loss"]) < 2e-3 * ref["final_val_loss"]


def test_parallel_modes_need_torchrun(tmp_path, capsys, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert cli_main(["train", "--tiny", "--fsdp", "--out", str(tmp_path)]) == 2
    assert "--fsdp runs under torchrun" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        cli_main(["train", "--tiny", "--fsdp", "--ddp", "--out", str(tmp_path)])
    assert exc.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_repeats_train_each_run_again_and_compare_means(tmp_path, capsys):
    assert cli_main(["train", "--tiny", "--no-spread", "--steps", "2", "--repeats", "2", "--out", str(tmp_path)]) == 0
    log = json.loads((tmp_path / "train_log.json").read_text())
    assert [r["label"] for r in log["runs"]] == ["hf #1", "hf #2", "coda #1", "coda #2"]
    out = capsys.readouterr().out
    assert "means over the repeats" in out and "+0.00 %" in out


@pytest.mark.parametrize("flags", [[], ["--fp8-lm-head"], ["--pow2-scales"], ["--row-scaling"],
                                   ["--row-scaling", "--fast-accum", "all"]],
                         ids=["bf16-lm-head", "fp8-lm-head", "pow2", "row-wise", "row-wise-fast-accum"])
def test_fp8_precision_adds_an_fp8_coda_run_next_to_the_bf16_one(tmp_path, flags):
    argv = ["train", "--tiny", "--no-spread", "--steps", "3", "--precision", "fp8", "--out", str(tmp_path)]
    assert cli_main(argv + flags) == 0
    log = json.loads((tmp_path / "train_log.json").read_text())
    runs = {r["label"]: r for r in log["runs"]}
    assert list(runs) == ["hf", "coda", "coda_fp8"] and log["config"]["precision"] == "fp8"
    assert log["config"]["fp8_lm_head"] is ("--fp8-lm-head" in flags)
    assert log["config"]["pow2_scales"] is ("--pow2-scales" in flags)
    assert log["config"]["row_scaling"] is ("--row-scaling" in flags)
    assert log["config"]["fast_accum"] == ("all" if "--fast-accum" in flags else "none")
    pairs = list(zip(runs["coda"]["steps"], runs["coda_fp8"]["steps"]))  # same weights and data
    for a, b in pairs:
        assert abs(a["loss"] - b["loss"]) < 2e-2 * a["loss"]
    # ... but in FP8: a run that fell back to bf16 would log the bf16 run's losses
    assert any(a["loss"] != b["loss"] for a, b in pairs)


@pytest.mark.parametrize("flag", ["--fp8-lm-head", "--pow2-scales", "--row-scaling"])
def test_fp8_flags_need_fp8(tmp_path, capsys, flag):
    assert cli_main(["train", "--tiny", flag, "--out", str(tmp_path)]) == 2
    assert f"{flag} goes with --precision fp8" in capsys.readouterr().out


@pytest.mark.parametrize("flags", [["--fast-accum", "forward"], ["--precision", "fp8", "--fast-accum", "all"]],
                         ids=["bf16", "block-recipe"])
def test_fast_accumulation_needs_the_row_wise_recipe(tmp_path, capsys, flags):
    assert cli_main(["train", "--tiny", *flags, "--out", str(tmp_path)]) == 2
    assert "--fast-accum goes with --precision fp8 --row-scaling" in capsys.readouterr().out


def test_the_fp8_lm_head_is_refused_with_the_row_wise_recipe(tmp_path, capsys):
    argv = ["train", "--tiny", "--precision", "fp8", "--fp8-lm-head", "--row-scaling", "--out", str(tmp_path)]
    assert cli_main(argv) == 2
    assert "the FP8 LM head runs the block recipe" in capsys.readouterr().out
